// stb_image_write (Debian's libstb-dev), which the data tests use to write their PNG and JPEG
// fixtures, compiled once. In a sanitizer build this file alone is built without UBSan's
// shift-base check (tests/CMakeLists.txt): the JPEG writer's bit buffer (stbiw__jpg_writeBits)
// is a signed int that it shifts left past the sign bit, "left shift of negative value", an open
// upstream bug (github.com/nothings/stb issue 1433, fix proposed in pull request 1617). In C++20
// that shift is defined, and GCC defines it in every mode (GCC manual, "Integers implementation":
// GCC "does not use the latitude given in C99 and C11 only to treat certain aspects of signed '<<'
// as undefined"), so the files it writes are right; only the sanitizer's C++17 rule is broken.
// Test code only: the engine reads images with stb_image (the decoder), which stays fully checked.
#define STB_IMAGE_WRITE_IMPLEMENTATION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#include <stb_image_write.h>
#pragma GCC diagnostic pop
