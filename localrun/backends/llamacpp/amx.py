"""Intel AMX and llama.cpp: keep llama.cpp's repacked weights, deny it AMX.

llama.cpp's CPU backend has extra buffer types for weights: AMX tiles (Intel Xeons since Sapphire
Rapids) and repacked blocks (Q4_0, Q4_K, IQ4_NL, ... interleaved for its AVX2/AVX-512 matmuls). The
AMX path of the llama.cpp that llama-cpp-python 0.3.36 builds crashes on the first token on such CPUs
(SIGILL in a Firecracker VM, a general protection fault at ``ldtilecfg`` elsewhere: llama.cpp #20824,
#26954). Turning every extra type off (``use_extra_bufts = False``) drops the repacked weights too,
which prefill a Q4_0 or IQ4_NL model 1.4-1.7x faster (SmolLM2-135M, 256 tokens, 2 Intel Xeon vCPUs).

llama.cpp offers its AMX buffer type only once the kernel grants the process AMX tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, ``ggml_amx_init``); when the kernel refuses,
it goes on without AMX, every other extra type kept. :func:`deny_amx` makes that one request fail
with EPERM for this process, all its threads and every process it starts: a seccomp filter of eight
classic-BPF instructions (filters are inherited across fork and exec). Every other system call, and
every other ``arch_prctl``, goes through untouched. The filter asks for no speculative-store-bypass
mitigation (``SECCOMP_FILTER_FLAG_SPEC_ALLOW``), so the compute runs as fast as without it on kernels
that would otherwise turn that mitigation on for filtered processes.

This must run before llama.cpp lists its extra buffer types (once a process, at its first model load).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger("localrun.backends.amx")

_AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")

# x86-64 Linux: the syscall numbers, the arch_prctl code llama.cpp asks with, seccomp's constants
SYS_ARCH_PRCTL, SYS_SECCOMP = 158, 317
ARCH_REQ_XCOMP_PERM = 0x1023
AUDIT_ARCH_X86_64 = 0xC000003E
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC, SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 4
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

_denied: bool | None = None  # this process's filter: None = not tried yet


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the CPU advertises Intel AMX (the amx_* flags in /proc/cpuinfo on Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:  # not Linux: no way to tell here; llama.cpp's default stays
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            flags = set(line.split(":", 1)[1].split())
            return any(f in flags for f in _AMX_FLAGS)
    return False


class _Insn(ctypes.Structure):  # struct sock_filter
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def _program() -> list[_Insn]:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, ...) on x86-64 -> EPERM; everything else allowed. Each jump's
    false branch skips to the last instruction (allow)."""
    return [
        _Insn(BPF_LD_W_ABS, 0, 0, _ARCH),
        _Insn(BPF_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),
        _Insn(BPF_LD_W_ABS, 0, 0, _NR),
        _Insn(BPF_JEQ_K, 0, 3, SYS_ARCH_PRCTL),
        _Insn(BPF_LD_W_ABS, 0, 0, _ARG0_LOW),
        _Insn(BPF_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        _Insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),
        _Insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]


def deny_amx() -> bool:
    """Make the kernel's AMX permission request fail for this process (every thread) and its children,
    once a process. True when it is in place; False off x86-64 Linux or where the kernel would not take
    the filter (the caller then turns llama.cpp's extra buffer types off instead)."""
    global _denied
    if _denied is not None:
        return _denied
    _denied = False
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        insns = _program()
        prog = _Prog(len(insns), (_Insn * len(insns))(*insns))
        # unprivileged processes may add a filter only with no_new_privs (exec can then never gain
        # privileges: no setuid program is run from a runner)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        flags = SECCOMP_FILTER_FLAG_TSYNC | SECCOMP_FILTER_FLAG_SPEC_ALLOW
        rc = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog))
        if rc != 0:  # -1: errno; > 0: a thread that could not take it (TSYNC)
            raise OSError(ctypes.get_errno() if rc < 0 else 0, f"seccomp() returned {rc}")
    except (OSError, AttributeError) as exc:
        log.info("cannot keep llama.cpp from AMX (%s): its extra buffer types go off instead", exc)
        return False
    _denied = True
    return True


__all__ = ["cpu_has_amx", "deny_amx"]
