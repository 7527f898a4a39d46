"""Stand-in CANN libraries: MindSpore's Ascend plugin loaded, and its dry run (`MS_SIMULATION_LEVEL` 0 and 1)
compiled, on a machine with no Ascend toolkit and no NPU. TEST SETUP ONLY.

What they are. MindSpore's wheel (the CPU one from PyPI too) ships its Ascend plugin
(`mindspore/lib/plugin/libmindspore_ascend.so.2` and `plugin/ascend/*.so`), linked against ~33 CANN
libraries that only the toolkit installs. `build()` reads the installed plugin with readelf/nm/strings and
generates:
- one `libascend_standins.so`: every symbol the plugin's libraries need and nothing in the wheel or the
  system defines (~1260), as a function that returns 0 (`STANDIN_TRACE=1` prints each call on stderr),
  zeroed 4 KiB data objects, typeinfo, and vtables of return-0 functions; a `...::Instance()` or
  `GetInstance()` accessor returns a 4 KiB dummy object whose vtable is return-0 functions; the API names
  MindSpore dlsym()s at run time (acl*, aclnn*, rt*, Hccl*, Msprof*: strings in the plugin) too;
- the hand-written ones in handwritten/: `ge::StatusFactory` with a real std::map (MindSpore's static
  initialisers insert into it inline), `ge::OperatorFactory::CreateOperator` returning an empty
  24-byte `ge::Operator` by value (the backend copies its shared_ptr at level 1), securec's *_s functions;
- one tiny library per missing CANN name (its SONAME: libascendcl.so, libhccl.so, libge_runner.so, ...)
  that only DT_NEEDs libascend_standins.so, in `<cache>/toolkit/latest/lib64` (MindSpore derives the
  toolkit's root from the path of the library defining aclrtMalloc: it must contain `latest`);
- a Python package `hccl` with `sys_version.__sys_version__` (MindSpore's `init()` reads the CANN wheel's
  version), in `<cache>/pyshim`, put on PYTHONPATH only by `environment()`. No `te` package: with one,
  MindSpore imports te.tik custom ops and dies; without, it logs a harmless CRITICAL line.

Why that is enough: in a dry run MindSpore replaces every acl* function pointer with its own simulation
mocks and uses a dummy collective library (`CollectiveManager::InitializeDummyCommLib`), so the stand-ins
are never asked for a real result; they only have to load. Nothing runs on a device and no collective
moves data: what the dry run gives is the compiler's (frontend, parallel passes, and at level 1 the
backend's kernel selection and memory plan), not any number a device would compute.

Built with gcc/g++ in ~15 s, once per MindSpore version and generator, into
`$XDG_CACHE_HOME/llm-pretrain/ascend-standins-<version>-<hash>/` (default ~/.cache). No binary is kept in
the repository; a host with the real toolkit uses its own libraries and never these.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
HANDWRITTEN = HERE / "handwritten"
TOOLS = ("gcc", "g++", "readelf", "nm", "strings", "c++filt")
HCCL_VERSION = "8.3.RC1"

# Libraries MindSpore dlopen()s by name from <toolkit>/lib64 at run time (not in any DT_NEEDED).
EXTRA_DLOPEN_LIBS = [
    "libascendcl.so", "libacl_op_compiler.so", "libacl_tdt_channel.so", "libmsprofiler.so",
    "libhccl.so", "libopapi.so", "libnnopbase.so", "libaclnn_ops_infer.so", "libaclnn_ops_train.so",
    "libaclnn_math.so", "libaclnn_rand.so", "libruntime.so", "libge_runner.so", "libplatform.so",
    "libascend_dump.so", "libacl_cblas.so", "libascend_hal.so", "libprofapi.so", "libatb.so",
    "libascend_ml.so", "libge_runner_v2.so", "libdvpp_vpc.so", "libacl_dvpp.so", "libacl_dvpp_op.so",
    "libacl_dvpp_mpi.so", "libtsdclient.so", "libaicpu_kernels.so",
]
# names MindSpore looks up with dlsym(): strings in the plugin's libraries
_API = re.compile(r"^(acl[a-z]*[A-Z][A-Za-z0-9_]*|aclnn[A-Za-z0-9_]+|rt[A-Z][A-Za-z0-9_]+|Hccl[A-Za-z0-9_]+|"
                  r"Hcom[A-Za-z0-9_]+|hcom[A-Z][A-Za-z0-9_]+|Msprof[A-Za-z0-9_]+|aclprof[A-Za-z0-9_]+)$")
_GENERIC_C = r'''
#include <stdio.h>
#include <stdlib.h>
static int trace = -1;
static int tracing(void) {
  if (trace < 0) { const char *e = getenv("STANDIN_TRACE"); trace = (e && *e && *e != '0'); }
  return trace;
}
long standin_generic(const char *name) {
  if (tracing()) fprintf(stderr, "[standin] %s\n", name);
  return 0;
}
long standin_vfunc(void) {
  if (tracing()) fprintf(stderr, "[standin] <virtual call on a stand-in vtable>\n");
  return 0;
}
'''


class Unavailable(RuntimeError):
    """The stand-ins cannot be built here (a tool is missing, or the wheel has no Ascend plugin)."""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _sh(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def _is_elf64_x86(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return head[:4] == b"\x7fELF" and head[4] == 2 and int.from_bytes(head[18:20], "little") == 62


def _dyn_info(path: str) -> tuple[list[str], list[str]]:
    out = _sh(["readelf", "-dW", path])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    dirs = []
    for rp in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.*?)\]", out):
        dirs += [os.path.normpath(d.replace("$ORIGIN", os.path.dirname(path))) for d in rp.split(":") if d]
    return needed, dirs


def _system_dirs() -> list[str]:
    dirs = []
    try:
        for line in _sh(["ldconfig", "-p"]).splitlines()[1:]:
            m = re.search(r"=> (.+)$", line)
            if m and os.path.dirname(m.group(1)) not in dirs:
                dirs.append(os.path.dirname(m.group(1)))
    except (OSError, subprocess.CalledProcessError):
        pass
    return dirs + ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"]


def _nm(path: str, undefined: bool) -> set[str]:
    try:
        out = _sh(["nm", "-D", "--undefined-only" if undefined else "--defined-only", path])
    except subprocess.CalledProcessError:
        return set()
    found = set()
    for line in out.splitlines():
        p = line.split()
        if undefined and len(p) == 2 and p[0] == "U":       # strong only: a weak one may stay missing
            found.add(p[1].split("@")[0])
        elif not undefined and len(p) == 3:
            found.add(p[2].split("@")[0])
    return found


def _relocs(path: str) -> dict[str, set[str]]:
    kinds = defaultdict(set)
    for line in _sh(["readelf", "-rW", path]).splitlines():
        p = line.split()
        if len(p) >= 5 and p[2].startswith("R_X86_64_"):
            kinds[p[4].split("@")[0]].add(p[2])
    return kinds


def _demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out))


def _mindspore(python: str) -> tuple[str, str, str, list[str]]:
    """(version, package dir, the interpreter's real path, the shared objects a CPU `import mindspore` maps)."""
    code = ("import mindspore, mindspore._c_expression, os, sys;"
            "print(mindspore.__version__); print(os.path.dirname(mindspore.__file__));"
            "print(os.path.realpath(sys.executable));"
            "[print(l.split()[5]) for l in open('/proc/self/maps') if len(l.split())>=6 and '.so' in l.split()[5]]")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env["GLOG_v"] = "3"
    lines = _sh([python, "-c", code], env=env).splitlines()
    return lines[0], lines[1], lines[2], sorted(set(lines[3:]))


def _generator_hash() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for src in sorted(HANDWRITTEN.iterdir()):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:12]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm-pretrain"


def build(python: str = sys.executable, cache: Path | None = None) -> Path:
    """The stand-ins' root for this interpreter's MindSpore (built if not cached): `<root>/toolkit/latest`
    holds lib64/, `<root>/pyshim` the hccl package. Raises Unavailable when they cannot be built here."""
    if missing_tools():
        raise Unavailable(f"no {', '.join(missing_tools())} on PATH (Debian: apt-get install gcc g++ binutils)")
    version, ms_dir, exe, loaded = _mindspore(python)
    plugin = os.path.join(ms_dir, "lib", "plugin")
    if not os.path.exists(os.path.join(plugin, "libmindspore_ascend.so.2")):
        raise Unavailable(f"MindSpore {version} at {ms_dir} has no Ascend plugin (lib/plugin/libmindspore_ascend.so.2)")
    root = (cache or cache_root()) / f"ascend-standins-{version}-{_generator_hash()}"
    if (root / "complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    try:
        _generate(ms_dir, exe, loaded, tmp)
        (tmp / "complete").write_text(f"mindspore {version} at {ms_dir}\n")
        try:
            tmp.rename(root)
        except OSError:                     # another session built it first
            if not (root / "complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def environment(root: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with the stand-in toolkit in place of a real one."""
    env = dict(os.environ if base is None else base)
    home = str(root / "toolkit" / "latest")
    env.update({"ASCEND_HOME_PATH": home, "ASCEND_TOOLKIT_HOME": home, "ASCEND_OPP_PATH": f"{home}/opp"})
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (f"{home}/lib64", env.get("LD_LIBRARY_PATH")) if p)
    env["PYTHONPATH"] = ":".join(p for p in (str(root / "pyshim"), env.get("PYTHONPATH")) if p)
    for key in ("MS_SIMULATION_LEVEL", "RANK_SIZE", "RANK_ID"):
        env.pop(key, None)
    return env


def _generate(ms_dir: str, exe: str, loaded: list[str], root: Path) -> None:
    lib64, work = root / "toolkit" / "latest" / "lib64", root / "build"
    for d in (lib64, root / "toolkit" / "latest" / "opp", work, root / "pyshim" / "hccl"):
        d.mkdir(parents=True, exist_ok=True)
    (root / "pyshim" / "hccl" / "__init__.py").write_text('"""Stand-in for the CANN hccl wheel: its version only."""\n')
    (root / "pyshim" / "hccl" / "sys_version.py").write_text(f'__sys_version__ = "{HCCL_VERSION}"\n')

    plugin = os.path.join(ms_dir, "lib", "plugin")
    roots = [os.path.join(plugin, "libmindspore_ascend.so.2"), os.path.join(plugin, "libmindspore_ops_ascend.so")]
    for dp, _, fns in os.walk(os.path.join(plugin, "ascend")):
        roots += [os.path.join(dp, fn) for fn in sorted(fns)
                  if ".so" in fn and not os.path.islink(os.path.join(dp, fn)) and _is_elf64_x86(os.path.join(dp, fn))]
    base_dirs = [ms_dir, os.path.join(ms_dir, "lib"), plugin, os.path.join(plugin, "ascend")] + _system_dirs()
    shipped = {}           # a library anywhere in the wheel is found through the loading chain's RPATHs
    for dp, _, fns in os.walk(ms_dir):
        for fn in fns:
            if ".so" in fn and _is_elf64_x86(os.path.join(dp, fn)):
                shipped.setdefault(fn, os.path.join(dp, fn))

    closure, missing, seen, stack = [], set(), set(), list(roots)
    while stack:
        p = os.path.realpath(stack.pop())
        if p in seen:
            continue
        seen.add(p)
        closure.append(p)
        needed, rdirs = _dyn_info(p)
        for n in needed:
            found = next((os.path.join(d, n) for d in rdirs + base_dirs
                          if os.path.exists(os.path.join(d, n)) and _is_elf64_x86(os.path.join(d, n))), shipped.get(n))
            if found:
                stack.append(found)
            else:
                missing.add(n)

    defined = set()
    for p in set(closure) | set(loaded) | {exe}:
        if os.path.exists(p):
            defined |= _nm(p, False)
    wanted, relk = set(), defaultdict(set)
    for p in closure:
        u = _nm(p, True) - defined
        if u:
            wanted |= u
            for s, k in _relocs(p).items():
                if s in u:
                    relk[s] |= k
        if "/plugin/" in p and "ms_kernels" not in p and "custom_" not in p:
            strs = subprocess.run(["strings", "-a", "-n", "6", p], capture_output=True, text=True).stdout.split()
            wanted |= {t for t in strs if _API.match(t) and t not in defined and not t.endswith("_") and len(t) < 120}
    syms = sorted(wanted)

    objs, hand = [], set()
    for src in sorted(HANDWRITTEN.iterdir()):
        obj = work / (src.name + ".o")
        if src.suffix == ".c":
            cmd = ["gcc", "-O1", "-fPIC", "-c", str(src), "-o", str(obj)]
        elif src.suffix == ".cc":            # the plugin's libraries use the old C++ ABI
            cmd = ["g++", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=0", "-O1", "-fPIC", "-c", str(src), "-o", str(obj)]
        else:
            continue
        subprocess.run(cmd, check=True)
        objs.append(str(obj))
        hand |= {p[2] for p in (l.split() for l in _sh(["nm", "--defined-only", str(obj)]).splitlines())
                 if len(p) == 3 and p[1] in "TDBRVWu"}

    dem = _demangle([s for s in syms if s.startswith("_Z")])
    funcs, datas, tinfos, tnames, vtables = [], [], [], [], []
    for s in syms:
        if s in hand:
            continue
        if s.startswith("_ZTV"):
            vtables.append(s)
        elif s.startswith("_ZTI"):
            tinfos.append(s)
        elif s.startswith("_ZTS"):
            tnames.append(s)
        elif s.startswith(("_ZTT", "_ZGV")):
            datas.append(s)
        elif s.startswith("_Z") and "(" not in dem.get(s, s) and "R_X86_64_JUMP_SLOT" not in relk[s]:
            datas.append(s)                  # a static data member
        else:
            funcs.append(s)
    for v in vtables:                        # the vtables we define need their typeinfo
        ti = "_ZTI" + v[4:]
        if ti not in tinfos and ti not in hand and ti not in defined:
            tinfos.append(ti)
    for ti in tinfos:
        ts = "_ZTS" + ti[4:]
        if ts not in tnames and ts not in hand and ts not in defined:
            tnames.append(ts)

    asm, singletons = [".text", ".p2align 4"], set()
    for i, s in enumerate(funcs):
        asm += [f".globl {s}", f".type {s},@function", f"{s}:"]
        if re.search(r"::(Ge|Get)?Instance\(\)$", dem.get(s, s)):      # a singleton: a dummy object
            singletons.add(s)
            asm += [f"  leaq .Lobj{i}(%rip), %rax", "  ret"]
        else:
            asm += [f"  leaq .Lname{i}(%rip), %rdi", "  jmp standin_generic@PLT"]
        asm += [f".size {s}, .-{s}"]
    asm += ["", ".section .rodata"] + [f".Lname{i}: .asciz \"{s}\"" for i, s in enumerate(funcs)]
    for s in tnames:
        asm += [f".globl {s}", f".type {s},@object", f"{s}: .asciz \"{s[4:]}\"", f".size {s}, .-{s}"]
    asm += ["", ".section .data.rel,\"aw\"", ".p2align 4"]
    for s in tinfos:
        asm += [f".globl {s}", f".type {s},@object", f"{s}:", "  .quad _ZTVN10__cxxabiv117__class_type_infoE+16",
                f"  .quad _ZTS{s[4:]}", f".size {s}, 16"]
    for s in vtables:
        asm += [f".globl {s}", f".type {s},@object", f"{s}:", "  .quad 0", f"  .quad _ZTI{s[4:]}"]
        asm += ["  .quad standin_vfunc"] * 62 + [f".size {s}, 512"]
    asm += [".p2align 4", ".globl standin_vtable_cxx", "standin_vtable_cxx:", "  .quad 0", "  .quad 0"]
    asm += ["  .quad standin_vfunc"] * 126
    for i, s in enumerate(funcs):
        if s in singletons:
            asm += [".p2align 4", f".Lobj{i}:", "  .quad standin_vtable_cxx+16", "  .zero 4088"]
    asm += ["", ".bss", ".p2align 6"]
    for s in datas:
        asm += [f".globl {s}", f".type {s},@object", f"{s}: .zero 4096", f".size {s}, 4096"]
    asm += ["", ".section .note.GNU-stack,\"\",@progbits", ""]
    (work / "auto_standins.S").write_text("\n".join(asm))
    (work / "generic.c").write_text(_GENERIC_C)
    subprocess.run(["gcc", "-O1", "-fPIC", "-c", str(work / "generic.c"), "-o", str(work / "generic.o")], check=True)
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib64 / "libascend_standins.so"),
                    "-Wl,-soname,libascend_standins.so", str(work / "auto_standins.S"), str(work / "generic.o"),
                    *objs, "-ldl", "-lpthread"], check=True)
    (work / "empty.c").write_text("/* forwards to libascend_standins.so through DT_NEEDED */\n")
    for n in sorted(missing | set(EXTRA_DLOPEN_LIBS) - {"libascend_standins.so"}):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib64 / n), f"-Wl,-soname,{n}", "-Wl,--no-as-needed",
                        str(work / "empty.c"), f"-L{lib64}", "-lascend_standins", "-Wl,-rpath,$ORIGIN"], check=True)
    (root / "manifest.txt").write_text(
        f"missing CANN libraries ({len(missing)}): {' '.join(sorted(missing))}\n"
        f"return-0 functions: {len(funcs)} ({len(singletons)} singleton accessors), data objects: {len(datas)}, "
        f"vtables: {len(vtables)}, typeinfo: {len(tinfos)}, hand-written symbols used: {len(hand & set(syms))}\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    built = build()
    print(built)
    print((built / "manifest.txt").read_text(), end="")
