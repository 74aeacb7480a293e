"""Compile engine/kernels' C++ extension modules into a directory, and import them from one.

``torch.utils.cpp_extension.load`` builds and imports in one call. That cannot build a module
for another CPU class (importing an AVX-512 build on an AVX2 CPU may die of SIGILL at the first
AVX-512 instruction its initialisers run), and it keeps builds in one writable directory only.
Here the two are apart:

- :func:`build_all` compiles modules into a directory and writes beside each ``<name>.so`` a
  stamp ``<name>.json``: what it was built from (sources and headers by hash, flags, torch,
  Python ABI) and the hash of the ``.so`` itself. Nothing is imported.
- :func:`load` imports a module from the first directory whose stamp matches what this process
  would build: a read-only prebuilt one (a Docker image carries every variant), else the
  writable cache, where a missing, stale or damaged module is compiled first, with the same
  commands. A ``.so`` is hashed before it is opened, so a truncated or altered file is
  rebuilt instead of handed to the dynamic loader.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("engine.kernels")

STAMP_FORMAT = 1
_STD = "-std=c++20"


class KernelBuildError(RuntimeError):
    """A module could not be compiled or linked (the compiler's last words included)."""


@dataclass(frozen=True)
class Extension:
    """One Python extension module: ``PyInit_<name>`` comes from ``TORCH_EXTENSION_NAME``."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()


def compiler() -> str:
    """``$CXX`` or ``c++``, the compiler torch's own JIT builds would use."""
    from torch.utils.cpp_extension import get_cxx_compiler

    return get_cxx_compiler()


def _system_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    python = sysconfig.get_path("include", scheme="posix_prefix")
    return [*include_paths(), *([python] if python else [])]


def compile_command(
    ext: Extension,
    source: Path,
    output: str | Path,
    *,
    module_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The compiler command for one source of ``ext`` (``extra`` goes last, so it wins)."""
    includes = [f"-I{source.parent}"]
    for path in _system_includes():
        includes += ["-isystem", path]
    return [
        compiler(),
        f"-DTORCH_EXTENSION_NAME={module_name or ext.name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *includes,
        "-fPIC",
        _STD,
        *ext.cflags,
        *extra,
        "-c",
        str(source),
        "-o",
        str(output),
    ]


def link_command(ext: Extension, objects: Sequence[Path], output: str | Path) -> list[str]:
    """The linker command: a shared object against libtorch, as torch's JIT links one."""
    from torch.utils.cpp_extension import library_paths

    libs = [f"-L{p}" for p in library_paths()]
    return [
        compiler(),
        *map(str, objects),
        "-shared",
        *ext.ldflags,
        *libs,
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
        "-o",
        str(output),
    ]


def sources_digest(ext: Extension) -> str:
    h = hashlib.sha256()
    for path in (*ext.sources, *sorted(ext.headers)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def stamp_inputs(ext: Extension, sources_sha256: str | None = None) -> dict[str, object]:
    """What a build depends on, and what a running process must match to import it: the
    sources and headers (by content, not path: the image's build tree and its installed
    package hold the same bytes), the flags, torch and the Python ABI."""
    return {
        "format": STAMP_FORMAT,
        "module": ext.name,
        "sources_sha256": sources_sha256 or sources_digest(ext),
        "std": _STD,
        "cflags": list(ext.cflags),
        "ldflags": list(ext.ldflags),
        "cxx11_abi": torch.compiled_with_cxx11_abi(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "python_ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }


def paths(ext: Extension, directory: Path) -> tuple[Path, Path]:
    """``<dir>/<name>.so`` and its stamp ``<dir>/<name>.json``."""
    return directory / f"{ext.name}.so", directory / f"{ext.name}.json"


def check(ext: Extension, directory: Path) -> str | None:
    """Why the module in ``directory`` must not be imported here, or ``None`` if it may be."""
    so, stamp_path = paths(ext, directory)
    if not so.is_file() or not stamp_path.is_file():
        return f"no {so.name} with its stamp"
    try:
        stamp = json.loads(stamp_path.read_text())
        built_from = stamp["inputs"]
        want_so = stamp["so_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"stamp unreadable ({type(exc).__name__}: {exc})"
    inputs = stamp_inputs(ext)
    if built_from != inputs:
        keys = sorted(
            k for k in inputs.keys() | built_from.keys() if built_from.get(k) != inputs.get(k)
        )
        detail = ", ".join(f"{k} {built_from.get(k)!r} != {inputs.get(k)!r}" for k in keys[:3])
        return f"built for other inputs: {_shorten(detail)}"
    if _file_digest(so) != want_so:
        return f"{so.name} does not match its stamp's hash (truncated or altered)"
    return None


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # no compiler at all
        return f"{cmd[0]}: {exc}"
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout)[-4000:]


def _object_key(cmd: list[str], sources_sha256: str) -> str:
    h = hashlib.sha256("\0".join(cmd).encode())
    h.update(sources_sha256.encode() + torch.__version__.encode())
    return h.hexdigest()[:16]


def build_all(
    exts: Sequence[Extension],
    out_dir: Path,
    *,
    obj_dir: Path | None = None,
    jobs: int | None = None,
) -> dict[str, str | None]:
    """Compile and link every module of ``exts`` into ``out_dir``, importing none of them.

    All sources of all modules share one pool of ``jobs`` compilers (default: one per core),
    the largest first. With ``obj_dir``, object files are kept there, keyed by their command
    and inputs, so a change to one source recompiles only that one. Returns module name ->
    ``None`` when it was built, else the error.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if obj_dir is None:
            obj_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vs-kernels-")))
        obj_dir.mkdir(parents=True, exist_ok=True)
        # the inputs as they are now: objects and stamps are labelled with these, and a
        # source edited while the compiler ran fails the build instead of being mislabelled
        digests = {ext.name: sources_digest(ext) for ext in exts}
        objects: dict[str, list[Path]] = {}
        todo: list[tuple[str, Path, list[str]]] = []
        for ext in exts:
            objects[ext.name] = []
            for src in ext.sources:
                key = _object_key(compile_command(ext, src, "OUT"), digests[ext.name])
                obj = obj_dir / f"{ext.name}.{src.stem}-{key}.o"
                objects[ext.name].append(obj)
                if not obj.is_file():
                    todo.append(
                        (ext.name, obj, compile_command(ext, src, f"{obj}.tmp{os.getpid()}"))
                    )
        todo.sort(key=lambda job: -Path(job[2][-3]).stat().st_size)

        def compile_one(job: tuple[str, Path, list[str]]) -> str | None:
            _, obj, cmd = job
            err = _run(cmd)
            if err is None:
                os.replace(cmd[-1], obj)
            return err

        t0 = time.perf_counter()
        if todo:
            log.info(
                "cpu kernels: compiling %d source(s) of %s (%d at a time)",
                len(todo),
                ", ".join(sorted({name for name, _, _ in todo})),
                jobs or os.cpu_count() or 1,
            )
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            errors = list(pool.map(compile_one, todo))
        results: dict[str, str | None] = {ext.name: None for ext in exts}
        for (name, _, cmd), err in zip(todo, errors, strict=True):
            if err is not None and results[name] is None:
                results[name] = f"compiling {Path(cmd[-3]).name} failed:\n{err}"
        for ext in exts:
            if results[ext.name] is None and sources_digest(ext) != digests[ext.name]:
                for obj in objects[ext.name]:
                    obj.unlink(missing_ok=True)
                results[ext.name] = "its sources changed while they were compiled"
            if results[ext.name] is None:
                inputs = stamp_inputs(ext, digests[ext.name])
                results[ext.name] = _link(ext, objects[ext.name], out_dir, inputs)
            if results[ext.name] is None:
                log.info("cpu kernels: built %s in %.1f s", ext.name, time.perf_counter() - t0)
        for ext in exts:  # objects of older inputs of these modules
            for stale in obj_dir.glob(f"{ext.name}.*.o"):
                if stale not in objects[ext.name]:
                    stale.unlink(missing_ok=True)
    return results


def _link(
    ext: Extension, objects: list[Path], out_dir: Path, inputs: dict[str, object]
) -> str | None:
    so, stamp_path = paths(ext, out_dir)
    tmp = so.with_name(f"{so.name}.tmp{os.getpid()}")
    err = _run(link_command(ext, objects, tmp))
    if err is not None:
        tmp.unlink(missing_ok=True)
        return f"linking failed:\n{err}"
    stamp = {
        "inputs": inputs,
        "so_sha256": _file_digest(tmp),
        "compiler": _compiler_version(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp_stamp = stamp_path.with_name(f"{stamp_path.name}.tmp{os.getpid()}")
    tmp_stamp.write_text(json.dumps(stamp, indent=1) + "\n")
    # the .so first: a reader between the two renames sees a hash mismatch, never a stamp
    # vouching for a file it does not describe
    os.replace(tmp, so)
    os.replace(tmp_stamp, stamp_path)
    return None


def _compiler_version() -> str:
    try:
        out = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def build(ext: Extension, out_dir: Path, *, obj_dir: Path | None = None) -> None:
    """:func:`build_all` for one module; raises :class:`KernelBuildError` if it fails."""
    err = build_all([ext], out_dir, obj_dir=obj_dir)[ext.name]
    if err is not None:
        raise KernelBuildError(f"{ext.name}: {err}")


def import_module(ext: Extension, directory: Path) -> ModuleType:
    """Import ``<directory>/<name>.so`` (torch must be imported first: it holds libtorch)."""
    so, _ = paths(ext, directory)
    spec = importlib.util.spec_from_file_location(ext.name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"{so} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _locked(directory: Path, name: str) -> Iterator[None]:
    """One builder per module and cache directory across processes (the kernel drops the
    lock of a killed holder)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _try_import(ext: Extension, directory: Path) -> tuple[ModuleType | None, str | None]:
    reason = check(ext, directory)
    if reason is not None:
        return None, reason
    try:
        return import_module(ext, directory), None
    except Exception as exc:  # a file that passed its hash yet does not load
        return None, f"does not load ({type(exc).__name__}: {exc})"


def load(ext: Extension, prebuilt: Path | None, cache: Path | None) -> ModuleType:
    """The module from ``prebuilt`` (read only) if its stamp matches, else from ``cache``,
    compiled there first if it is missing, stale or damaged. ``cache=None`` never compiles:
    then a prebuilt module that cannot be used raises :class:`KernelBuildError`."""
    if prebuilt is not None:
        module, reason = _try_import(ext, prebuilt)
        if module is not None:
            return module
        log.warning(
            "cpu kernels: prebuilt %s in %s not used: %s; %s",
            ext.name,
            prebuilt,
            reason,
            f"using the build cache {cache}" if cache is not None else "not compiling",
        )
        if cache is None:
            raise KernelBuildError(f"{ext.name}: prebuilt module not usable: {reason}")
    if cache is None:
        raise KernelBuildError(f"{ext.name}: neither a prebuilt directory nor a build cache")
    module, reason = _try_import(ext, cache)
    if module is not None:
        return module
    with _locked(cache, ext.name):
        # another process may have built it while this one waited for the lock; a module that
        # passed its stamp yet did not load is built again in any case
        stale = check(ext, cache)
        if stale is not None or reason.startswith("does not load"):
            log.info("cpu kernels: compiling %s into %s (%s)", ext.name, cache, stale or reason)
            for leftover in [
                *cache.glob(f"{ext.name}.*.tmp*"),
                *cache.glob(f"obj/{ext.name}.*.tmp*"),
            ]:
                leftover.unlink(missing_ok=True)  # of a builder killed while it held the lock
            build(ext, cache, obj_dir=cache / "obj")
    module, reason = _try_import(ext, cache)
    if module is None:
        raise KernelBuildError(f"{ext.name}: built, yet {reason}")
    return module
