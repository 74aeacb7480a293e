"""Kernel modules built ahead into a read-only directory, and the loader that takes them.

The Docker image runs ``python -m engine.kernels --prebuild`` for every variant and the runtime
imports the one for its CPU from ``$VISION_SERVE_KERNELS_DIR`` without compiling; a stamp that
does not match, or a damaged file, falls back to a compile into the writable cache with one
log line saying why. The builder and loader are checked on a tiny extension (a second to
compile); the real modules on the build this machine already has (fast tier) and on a build of
every variant (slow tier: four variants at ~75 s of compiler time each on 2 cores, less the
objects of this CPU's own that the build cache already holds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import pytest

from engine import kernels
from engine.kernels import build

ROOT = Path(__file__).resolve().parents[2]

TINY_SOURCE = r"""
#include <Python.h>
#include "tiny.h"
#define VS_STR2(x) #x
#define VS_STR(x) VS_STR2(x)
#define VS_INIT2(n) PyInit_##n
#define VS_INIT(n) VS_INIT2(n)
static struct PyModuleDef tiny_module = {PyModuleDef_HEAD_INIT, VS_STR(TORCH_EXTENSION_NAME),
                                         nullptr, -1, nullptr};
PyMODINIT_FUNC VS_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&tiny_module);
  if (m != nullptr) PyModule_AddIntConstant(m, "answer", TINY_ANSWER);
  return m;
}
"""


@pytest.fixture
def tiny(tmp_path: Path, request: pytest.FixtureRequest) -> build.Extension:
    """A real extension module through the real compiler, small enough to build per test;
    its name is the test's, so no two tests import the same module in this process."""
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    (src_dir / "tiny.cpp").write_text(TINY_SOURCE)
    (src_dir / "tiny.h").write_text("#define TINY_ANSWER 42\n")
    return build.Extension(
        name="vs_tiny_" + "".join(c if c.isalnum() else "_" for c in request.node.name),
        sources=(src_dir / "tiny.cpp",),
        headers=(src_dir / "tiny.h",),
        cflags=("-O2", "-mavx2"),
    )


def _read_only(path: Path) -> dict[str, int]:
    """As the image's directory is at run time (compose's read-only root); returns its
    listing, to show afterwards that nothing was written there (root ignores the mode)."""
    for p in [*path.iterdir(), path]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return _listing(path)


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "engine.kernels"]


def _listing(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


def test_build_writes_the_module_and_its_stamp_without_importing_it(
    tiny: build.Extension, tmp_path: Path
) -> None:
    assert build.build_all([tiny], tmp_path / "pre") == {tiny.name: None}
    so, stamp_path = build.paths(tiny, tmp_path / "pre")
    stamp = json.loads(stamp_path.read_text())
    assert stamp["inputs"] == build.stamp_inputs(tiny)
    assert stamp["inputs"]["cflags"] == ["-O2", "-mavx2"]
    assert so.is_file() and tiny.name not in sys.modules
    assert sorted(p.name for p in (tmp_path / "pre").iterdir()) == sorted(
        [so.name, stamp_path.name]
    )


def test_the_loader_takes_a_prebuilt_module_without_a_compiler(
    tiny: build.Extension, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    build.build(tiny, tmp_path / "pre")
    before = _read_only(tmp_path / "pre")
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # a compile attempt would fail
    with caplog.at_level(logging.INFO, logger="engine.kernels"):
        module = build.load(tiny, tmp_path / "pre", tmp_path / "cache")
    assert module.answer == 42
    assert Path(module.__file__).parent == tmp_path / "pre"
    assert not (tmp_path / "cache").exists()
    assert _listing(tmp_path / "pre") == before
    assert _ours(caplog) == []


def test_a_stamp_for_another_torch_falls_back_to_a_compile_with_one_warning(
    tiny: build.Extension, tmp_path: Path, caplog
) -> None:
    build.build(tiny, tmp_path / "pre")
    _, stamp_path = build.paths(tiny, tmp_path / "pre")
    stamp = json.loads(stamp_path.read_text())
    stamp["inputs"]["torch"] = "2.0.0+cpu"
    stamp_path.write_text(json.dumps(stamp))
    with caplog.at_level(logging.INFO, logger="engine.kernels"):
        module = build.load(tiny, tmp_path / "pre", tmp_path / "cache")
    assert Path(module.__file__).parent == tmp_path / "cache"
    assert module.answer == 42
    [warning] = [r for r in _ours(caplog) if r.levelno >= logging.WARNING]
    assert "prebuilt" in warning.message and "torch '2.0.0+cpu'" in warning.message
    assert any("compiling" in r.message for r in _ours(caplog))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("truncate", "does not match its stamp's hash"),
        ("garbage", "does not match its stamp's hash"),
        ("restamped", "does not load (ImportError"),
        ("stamp", "stamp unreadable"),
        ("missing", "no vs_tiny_"),
    ],
)
def test_a_damaged_prebuilt_module_falls_back_to_a_compile(
    tiny: build.Extension, tmp_path: Path, caplog, damage: str, why: str
) -> None:
    build.build(tiny, tmp_path / "pre")
    so, stamp_path = build.paths(tiny, tmp_path / "pre")
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[:4096])
    elif damage == "garbage":
        so.write_bytes(b"\x7fELF" + os.urandom(2000))
    elif damage == "restamped":  # garbage whose hash the stamp vouches for: dlopen refuses
        so.write_bytes(b"\x7fELF" + os.urandom(2000))
        stamp = json.loads(stamp_path.read_text())
        stamp["so_sha256"] = hashlib.sha256(so.read_bytes()).hexdigest()
        stamp_path.write_text(json.dumps(stamp))
    elif damage == "stamp":
        stamp_path.write_text('{"inputs": ')
    else:
        so.unlink()
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        module = build.load(tiny, tmp_path / "pre", tmp_path / "cache")
    assert Path(module.__file__).parent == tmp_path / "cache"
    [warning] = _ours(caplog)
    assert why in warning.message, warning.message


def test_without_a_cache_a_stale_prebuilt_module_is_an_error_not_a_compile(
    tiny: build.Extension, tmp_path: Path
) -> None:
    build.build(tiny, tmp_path / "pre")
    (tmp_path / "src" / "tiny.h").write_text("#define TINY_ANSWER 43\n")
    with pytest.raises(build.KernelBuildError, match="sources_sha256"):
        build.load(tiny, tmp_path / "pre", cache=None)


def test_a_source_change_makes_the_cached_build_stale_and_rebuilds_it(
    tiny: build.Extension, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    build.build(tiny, cache, obj_dir=cache / "obj")
    assert build.check(tiny, cache) is None
    (tmp_path / "src" / "tiny.h").write_text("#define TINY_ANSWER 43\n")
    assert "sources_sha256" in build.check(tiny, cache)
    build.build(tiny, cache, obj_dir=cache / "obj")
    assert build.check(tiny, cache) is None
    assert len(list((cache / "obj").glob("*.o"))) == 1  # the older object is gone


def test_a_source_edited_while_it_compiles_fails_the_build_instead_of_mislabelling_it(
    tiny: build.Extension, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp names the sources as they were when the build began; an edit racing the
    compiler (a developer saving mid-build) must not leave a module stamped for sources it
    was not built from."""
    header = tmp_path / "src" / "tiny.h"
    editing_compiler = tmp_path / "editing-c++"
    editing_compiler.write_text(
        f"#!/bin/sh\necho '#define TINY_ANSWER 44' > {header}\nexec c++ \"$@\"\n"
    )
    editing_compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(editing_compiler))
    [err] = build.build_all([tiny], tmp_path / "pre", obj_dir=tmp_path / "obj").values()
    assert err is not None and "changed while" in err
    assert not any((tmp_path / "pre").iterdir()) and not any((tmp_path / "obj").iterdir())


def test_a_missing_compiler_is_a_clear_error(
    tiny: build.Extension, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    [err] = build.build_all([tiny], tmp_path / "pre").values()
    assert "/nonexistent/c++" in err
    with pytest.raises(build.KernelBuildError, match="nonexistent"):
        build.load(tiny, None, tmp_path / "cache")


def test_prebuild_covers_every_variant_and_the_int8_module() -> None:
    names = {ext.name for v in kernels.VARIANTS for ext in kernels.extensions(v)}
    assert names == {*kernels._MODULES.values(), kernels.INT8_MODULE}
    for variant, flags in kernels.VARIANTS.items():
        assert set(flags) <= set(kernels.decode_extension(variant).cflags)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        kernels.prebuild(Path("/nonexistent"), ["sse2"])


def _python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: the loaders are cached per process, and the environment is read
    at load."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


LOAD_BOTH = (
    "from engine.kernels import load_cpu_decode, load_int8_linear\n"
    "d, q = load_cpu_decode(), load_int8_linear()\n"
    "print(d.__file__, d.isa, q.__file__, sep='\\n')\n"
)


def test_the_runtime_loader_takes_this_cpus_prebuilt_modules(tmp_path: Path) -> None:
    """``load_cpu_decode``/``load_int8_linear`` with $VISION_SERVE_KERNELS_DIR, read only, an
    empty writable cache and no compiler: the modules come from the prebuilt directory. They
    are this machine's cached builds, copied with their stamps (the slow test below builds
    them with --prebuild)."""
    variant = kernels.cpu_variant()
    decode, int8 = kernels.load_cpu_decode(), kernels.load_int8_linear()
    if variant is None or decode is None or int8 is None:
        pytest.skip("this CPU runs no kernel variant, or no compiler built it")
    pre = tmp_path / "prebuilt"
    pre.mkdir()
    for ext, module in zip(kernels.extensions(variant), (decode, int8), strict=True):
        built_in = Path(module.__file__).parent
        if build.check(ext, built_in) is not None:
            pytest.skip(f"{ext.name}'s sources changed since this process loaded it")
        for path in build.paths(ext, built_in):
            shutil.copy(path, pre / path.name)
    before = _read_only(pre)
    env = {
        "VISION_SERVE_KERNELS_DIR": str(pre),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
        "CXX": "/nonexistent/c++",
    }
    proc = _python(["-c", LOAD_BOTH], env)
    assert proc.returncode == 0, proc.stderr
    decode_file, isa, int8_file = proc.stdout.split()
    assert Path(decode_file).parent == pre and Path(int8_file).parent == pre
    assert isa == ("avx2" if variant == "avx2" else "avx512")
    assert not (tmp_path / "cache").exists() and _listing(pre) == before


def _prebuilt_kernels(tmp_path: Path) -> Path:
    """``python -m engine.kernels --prebuild``'s directory. scripts/test.sh starts that build
    beside the whole suite (``VS_TEST_PREBUILT_KERNELS``: it writes ``kernels/``, its log and
    its exit code there), so its ~7 minutes of compiler time overlap the tests' waits instead
    of adding to the run; without it the build runs here."""
    shared = os.environ.get("VS_TEST_PREBUILT_KERNELS")
    if not shared:
        pre = tmp_path / "kernels"
        proc = subprocess.run(
            [sys.executable, "-m", "engine.kernels", "--prebuild", str(pre)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=2400,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return pre
    folder = Path(shared)
    deadline = time.monotonic() + 2400
    while not (folder / "rc").exists():
        assert time.monotonic() < deadline, "the background prebuild did not finish"
        time.sleep(5)
    log = (folder / "log").read_text() if (folder / "log").exists() else ""
    assert (folder / "rc").read_text().strip() == "0", log[-4000:]
    return folder / "kernels"


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_prebuild_of_every_variant_loads_here_without_recompiling(tmp_path: Path) -> None:
    """What the Dockerfile runs, on this machine: every variant builds (the AVX-512 ones too,
    on an AVX2 CPU, without being imported), and the runtime takes this CPU's modules from
    the directory without a compiler; ``--verify`` (the image build's own check) passes."""
    pre = _prebuilt_kernels(tmp_path)
    stamps = {p.stem: json.loads(p.read_text())["inputs"] for p in pre.glob("*.json")}
    assert set(stamps) == {*kernels._MODULES.values(), kernels.INT8_MODULE}
    for variant, name in kernels._MODULES.items():
        assert stamps[name]["cflags"] == list(kernels.decode_extension(variant).cflags)
    before = _read_only(pre)
    variant = kernels.cpu_variant()
    if variant is None:
        return
    env = {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    verify = _python(["-m", "engine.kernels", "--verify", str(pre)], env)
    assert verify.returncode == 0, verify.stderr
    assert f"{kernels._MODULES[variant]}: loads from {pre}" in verify.stdout
    proc = _python(["-c", LOAD_BOTH], {**env, "VISION_SERVE_KERNELS_DIR": str(pre)})
    assert proc.returncode == 0, proc.stderr
    decode_file, _, int8_file = proc.stdout.split()
    assert Path(decode_file).parent == pre and Path(int8_file).parent == pre
    assert not (tmp_path / "cache").exists() and _listing(pre) == before


def test_the_image_prebuilds_where_the_runtime_looks_and_nothing_hides_it() -> None:
    """The Dockerfile builds every variant into $VISION_SERVE_KERNELS_DIR as root (read-only
    for the runtime user) and checks they load; no compose mount covers that directory (a
    volume or tmpfs there would hide the image's modules and make every start compile)."""
    import yaml

    text = (ROOT / "Dockerfile").read_text()
    env = dict(re.findall(r"^(?:ENV)?\s*(\w+)=(\S+?)\s*\\?$", text, re.MULTILINE))
    kernels_dir = PurePosixPath(env["VISION_SERVE_KERNELS_DIR"])
    prebuild = text.index('--prebuild "$VISION_SERVE_KERNELS_DIR"')
    assert prebuild < text.index('--verify "$VISION_SERVE_KERNELS_DIR"')
    assert prebuild < text.index("\nUSER ")
    assert "TORCH_EXTENSIONS_DIR" in env  # the fallback's writable cache
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, service in services.items():
        mounts = [t.split(":")[0] for t in service.get("tmpfs", [])]
        volumes = [re.sub(r"\$\{[^}]*\}", "X", v) for v in service.get("volumes", [])]
        mounts += [v.split(":")[1] for v in volumes if ":" in v]
        for mount in map(PurePosixPath, mounts):
            assert mount != kernels_dir and mount not in kernels_dir.parents, (name, mount)
