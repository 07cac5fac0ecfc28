#!/usr/bin/env python3
"""Whether a GPU can launch every kernel as the CUDA backend launches it (issue 13, docs/cuda.md).

A block's threads share the multiprocessor's register file: a launch whose block needs more
registers than a block may have fails on the GPU ("too many resources requested for launch"),
however right its arithmetic. The CUDA emulator runs the kernels without registers, so it cannot
see this; nvcc's ptxas knows each kernel's registers per architecture, and the emulator knows the
blocks the backend launches. This script holds the two against each other:

  ptxas (nvcc --ptxas-options=-v): kernel, architecture -> registers a thread, spill bytes
  the emulator (EDGETRAIN_CUDA_EMU_LAUNCHES=<file>): kernel -> largest block it was launched with

A block needs ceil(threads / 32) warps of ceil(registers * 32 / 256) * 256 registers (the
allocation unit of sm_75 to sm_90) and may have 65536. Kernels are matched by name (templates and
namespaces dropped), the most registers of any instantiation on any architecture taken: an upper
bound. It fails on a block that does not fit, and on a launched kernel ptxas did not report.

  scripts/cuda_resources.py --launches build-emu/launches.txt --ptxas-log build-cuda/ptxas.log
  scripts/cuda_resources.py --launches build-emu/launches.txt --compile build-cuda [--archs 75,87]
(--compile: compiles backends/cuda/*.cu again as build-cuda's compile_commands.json does, with
ptxas's report, for the architectures given; the log form reuses a build's output.)
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

REGS_PER_BLOCK = 65536
ALLOC_UNIT = 256  # registers, allocated per warp


def base_name(name):
    """'void et::(anonymous namespace)::f<1, 2>(int)' or 'cuda::f<kX, 16>' -> 'f'."""
    name = name.replace("(anonymous namespace)", "anon")
    if name.startswith("void "):
        name = name[5:]
    name = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    return name.split("::")[-1]


def parse_ptxas(text):
    """ptxas -v output -> {mangled: {arch: (registers, spill store bytes)}}."""
    kernels, current, arch = {}, None, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
        if m:
            current, arch = m.group(1), m.group(2)
            kernels.setdefault(current, {})[arch] = [0, 0]
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and arch in kernels.get(current, {}):
            kernels[current][arch][1] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[current][arch][0] = int(m.group(1))
    return kernels


def compile_for_report(build, archs):
    commands = json.load(open(os.path.join(build, "compile_commands.json")))
    jobs = [c for c in commands if re.search(r"backends/cuda/[^/]+\.cu$", c["file"])]
    if not jobs:
        sys.exit(f"cuda_resources: no backends/cuda/*.cu in {build}/compile_commands.json")
    tmp = tempfile.mkdtemp()

    def run(job):
        args = shlex.split(job["command"])
        out = args.index("-o")
        args[out + 1] = os.path.join(tmp, os.path.basename(job["file"]) + ".o")
        args = [a for a in args if not a.startswith("--generate-code") and not a.startswith("-arch")]
        for arch in archs:
            args.append(f"--generate-code=arch=compute_{arch},code=sm_{arch}")
        args.append("--ptxas-options=-v")
        r = subprocess.run(args, cwd=job["directory"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"cuda_resources: {job['file']} did not compile:\n{r.stderr[-2000:]}")
        return r.stdout + r.stderr

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return "\n".join(pool.map(run, jobs))


def block_registers(threads, regs):
    warps = (threads + 31) // 32
    per_warp = (regs * 32 + ALLOC_UNIT - 1) // ALLOC_UNIT * ALLOC_UNIT
    return warps * per_warp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", required=True, help="the emulator's EDGETRAIN_CUDA_EMU_LAUNCHES file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ptxas-log", help="a build's output with nvcc's --ptxas-options=-v")
    src.add_argument("--compile", metavar="BUILD", help="a CUDA build folder whose .cu files to compile again")
    ap.add_argument("--archs", default="75,80,87,90", help="with --compile (default 75,80,87,90)")
    a = ap.parse_args()

    text = open(a.ptxas_log).read() if a.ptxas_log else compile_for_report(a.compile, a.archs.split(","))
    kernels = parse_ptxas(text)
    if not kernels:
        sys.exit("cuda_resources: no kernel in ptxas's report (was the build run with --ptxas-options=-v?)")
    names = subprocess.run(["c++filt"], input="\n".join(kernels), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    # base name -> arch -> (most registers, most spill bytes, the instantiation with the most registers)
    by_name = {}
    for mangled, demangled in zip(kernels, names):
        per_arch = by_name.setdefault(base_name(demangled), {})
        for arch, (regs, spills) in kernels[mangled].items():
            most, spilled, which = per_arch.get(arch, (0, 0, ""))
            per_arch[arch] = (max(most, regs), max(spilled, spills), demangled if regs > most else which)
    launched = {}
    for line in open(a.launches):
        parts = line.rsplit(None, 1)
        if len(parts) == 2:
            name = base_name(parts[0])
            launched[name] = max(launched.get(name, 0), int(parts[1]))
    if not launched:
        sys.exit(f"cuda_resources: no launch in {a.launches} (set EDGETRAIN_CUDA_EMU_LAUNCHES for the emulator run)")

    archs = sorted({arch for k in by_name.values() for arch in k})
    print(f"kernels launched on the emulator: {len(launched)}; reported by ptxas: {len(by_name)} ({', '.join(archs)})")
    print(f"{'kernel':44} {'block':>6} {'regs':>5} {'block regs':>11} {'of 65536':>9} {'spills':>7}")
    bad = []
    for name in sorted(launched, key=lambda n: -max((r for r, _, _ in by_name.get(n, {}).values()), default=0)):
        threads = launched[name]
        if name not in by_name:
            bad.append(f"{name}: launched with {threads} threads a block, but ptxas reported no such kernel")
            continue
        worst_arch = max(by_name[name], key=lambda arch: by_name[name][arch][0])
        regs, _, instance = by_name[name][worst_arch]
        spills = max(s for _, s, _ in by_name[name].values())
        need = block_registers(threads, regs)
        print(f"{name:44} {threads:6} {regs:5} {need:11} {need / REGS_PER_BLOCK:9.2f} {spills:7}")
        if need > REGS_PER_BLOCK:
            bad.append(f"{name}: a block of {threads} threads needs {need} registers on {worst_arch} "
                       f"({regs} a thread, {instance}), more than the {REGS_PER_BLOCK} a block may have: "
                       f"give it __launch_bounds__({threads}) or launch smaller blocks")
    # Jetson Nano (sm_53) and TX2 (sm_62) may give a block half of that; CUDA 13 builds neither, so
    # sm_75's registers stand in for theirs (an estimate: int_gemm_kernel's __launch_bounds__ makes
    # ptxas fit its block on any architecture it builds).
    lowest = archs[0] if archs else None
    if lowest:
        worst = max(((block_registers(t, by_name[n][lowest][0]), n) for n, t in launched.items()
                     if lowest in by_name.get(n, {}) and n != "int_gemm_kernel"), default=None)
        if worst:
            print(f"with {lowest}'s registers the largest block needs {worst[0]} ({worst[1]}): "
                  f"{worst[0] / 32768:.2f} of the 32768 sm_53 / sm_62 give a block (an estimate, not checked)")
    unlaunched = sorted(set(by_name) - set(launched))
    if unlaunched:
        print(f"not launched in this run (not checked): {', '.join(unlaunched)}")
    for b in bad:
        print("cuda_resources: " + b, file=sys.stderr)
    if bad:
        sys.exit(1)
    print("every launched kernel's block fits the registers a block may have, on every architecture")


if __name__ == "__main__":
    main()
