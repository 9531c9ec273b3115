"""llama.cpp for the peer sessions, built from the llama-cpp-python sdist for this CPU, cached.

The sdist (``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION``) carries
llama.cpp's whole tree under ``vendor/llama.cpp``. Two builds come from it:

* ``wheel``: the llama-cpp-python wheel (its ctypes bindings and libllama/libggml);
* ``tools``: llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-perplexity,
  ...) and its shared libraries, with cmake.

Both are built for the CPU they run on: AVX2 where ``/proc/cpuinfo`` has avx2, AVX-512 only
where it has avx512f, never the native build (it enables AMX, which crashes on these
machines). The cache folder is named by a key of the version, the flags, the machine and the
compiler, and a stamp inside records the flags; a build made on another CPU (a shared cache)
is never loaded, since its key differs.

Used by ``nox -s peers`` and ``nox -s bench``::

    python tools/llama_cpp_build.py flags     # the cmake flags for this CPU
    python tools/llama_cpp_build.py wheel     # build (once) and print the wheel's path
    python tools/llama_cpp_build.py tools     # build (once) and print the tools' bin folder
    python tools/llama_cpp_build.py tools --isa avx2   # the same without AVX-512
    python tools/llama_cpp_build.py source    # unpack (once) and print vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-server")


def cpu_flags(cpuinfo: str | None = None, isa: str | None = None) -> list[str]:
    """The cmake flags for this CPU: no native build, no AMX, AVX2/AVX-512 where present;
    with ``isa="avx2"``, AVX-512 off even where present (an AVX2 build on an AVX-512 host,
    to compare with qllama's kernels compiled for AVX2 there: benchmarks/isa.py)."""
    if isa not in (None, "avx2"):
        raise ValueError(f"unknown instruction set {isa!r} (known: avx2)")
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return flags
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    have = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have.update(line.partition(":")[2].split())
            break
    if isa == "avx2":
        have.discard("avx512f")
    for flag, option in (
        ("avx", "GGML_AVX"),
        ("avx2", "GGML_AVX2"),
        ("bmi2", "GGML_BMI2"),
        ("fma", "GGML_FMA"),
        ("f16c", "GGML_F16C"),
        ("avx512f", "GGML_AVX512"),
    ):
        flags.append(f"-D{option}={'ON' if flag in have else 'OFF'}")
    return flags


def _compiler() -> str:
    try:
        out = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def build_key(flags: list[str]) -> str:
    """The cache key of a build: version, flags, machine, compiler and Python."""
    ident = json.dumps(
        [VERSION, sorted(flags), platform.machine(), _compiler(), sys.version_info[:2]]
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """The qllama cache's ``peers`` folder, as :func:`qllama.defaults.cache_dir` resolves it.

    defaults.py is loaded by its path: this script runs before qllama (and its dependencies)
    may be installed.
    """
    path = Path(__file__).resolve().parent.parent / "qllama" / "defaults.py"
    spec = importlib.util.spec_from_file_location("_qllama_defaults", path)
    assert spec is not None and spec.loader is not None
    defaults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defaults)
    return Path(defaults.cache_dir()) / "peers"


def _publish(tmp: Path, final: Path) -> Path:
    """Rename a finished temporary folder into place (a concurrent builder may have won)."""
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.exists():
            raise
    return final


def sdist() -> Path:
    """The sdist, downloaded once from PyPI."""
    folder = cache_root() / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".download-"))
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*pip, PACKAGE, "-d", str(tmp)], check=True)
    (got,) = tmp.glob("*.tar.gz")
    final = folder / got.name
    got.rename(final)
    shutil.rmtree(tmp, ignore_errors=True)
    return final


def source() -> Path:
    """``vendor/llama.cpp`` of the unpacked sdist (the converter, gguf-py, tools, tests)."""
    final = cache_root() / f"src-{VERSION}"
    if not final.exists():
        archive = sdist()
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".unpack-"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        _publish(tmp, final)
    (root,) = final.iterdir()
    return root / "vendor" / "llama.cpp"


def _stamped(folder: Path, flags: list[str]) -> bool:
    stamp = folder / "stamp.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("flags") == flags


def wheel(flags: list[str] | None = None) -> Path:
    """The llama-cpp-python wheel built for this CPU (built once per key)."""
    flags = flags or cpu_flags()
    final = cache_root() / f"wheel-{build_key(flags)}"
    if not _stamped(final, flags):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".wheel-"))
        env = dict(os.environ, CMAKE_ARGS=" ".join(flags), CMAKE_BUILD_PARALLEL_LEVEL="2")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp), str(sdist())],
            check=True,
            env=env,
        )
        (tmp / "stamp.json").write_text(json.dumps({"flags": flags, "version": VERSION}))
        _publish(tmp, final)
    (whl,) = final.glob("*.whl")
    return whl


def tools(flags: list[str] | None = None) -> Path:
    """The bin folder of llama.cpp's tools built for this CPU (built once per key)."""
    flags = flags or cpu_flags()
    final = cache_root() / f"tools-{build_key(flags)}"
    if not _stamped(final, flags):
        src = source()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tools-"))
        configure = ["cmake", "-S", str(src), "-B", str(tmp / "build"), *flags]
        configure += ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF"]
        configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
        subprocess.run(configure, check=True)
        build = ["cmake", "--build", str(tmp / "build"), "-j", "2", "--target", *TOOLS]
        subprocess.run(build, check=True)
        (tmp / "stamp.json").write_text(json.dumps({"flags": flags, "version": VERSION}))
        _publish(tmp, final)
    return final / "build" / "bin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["flags", "wheel", "tools", "source", "key"])
    parser.add_argument("--isa", choices=["avx2"], help="build for AVX2 on an AVX-512 host")
    args = parser.parse_args(argv)
    flags = cpu_flags(isa=args.isa)
    out = {
        "flags": lambda: " ".join(flags),
        "key": lambda: build_key(flags),
        "wheel": lambda: wheel(flags),
        "tools": lambda: tools(flags),
        "source": source,
    }[args.what]()
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
