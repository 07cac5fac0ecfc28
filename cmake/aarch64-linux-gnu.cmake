# Cross build for 64-bit ARM Linux (the Jetson's CPU) with Debian's g++-aarch64-linux-gnu; tests run
# under qemu-user (scripts/test_aarch64.sh). Usage: cmake -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Libraries (libgomp, libstdc++, libc) from the cross toolchain's root only. Headers and CMake
# package files from the host as well: the dependencies are header-only and architecture-free
# (Eigen, nlohmann-json, CLI11, Catch2, stb), and Debian's cross g++ searches /usr/include after
# its own /usr/aarch64-linux-gnu/include, so the host's C library headers never shadow the target's.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# ctest (and catch_discover_tests at build time) run the test binaries through qemu. `-cpu max`
# emulates a CPU with every extension qemu knows, asimddp (sdot) included, so the NEON
# dot-product kernels run rather than fall back to scalar.
find_program(ET_QEMU_AARCH64 qemu-aarch64 REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR "${ET_QEMU_AARCH64};-L;/usr/aarch64-linux-gnu;-cpu;max")
