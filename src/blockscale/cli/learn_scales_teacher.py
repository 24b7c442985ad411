"""The teacher of ``blockscale learn-scales``: an explicit ``--teacher MODEL``, or (``--teacher-from-metadata``)
the source model a checkpoint's metadata names when that is a built-in or hub name, never a local path
(metadata is untrusted); whether two model arguments name one model; the vocabulary checks after loading."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import UsageError
from .checks import check_model

HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def teacher_from_metadata(ckpt: Path, recorded) -> str:
    """The recorded source model of ``ckpt`` when it is a built-in or hub name that is not also a local path."""
    from ..models.hf import BUILTIN_MODELS

    if recorded is None:
        raise UsageError(f"--teacher-from-metadata: the metadata of {ckpt} names no source model; pass --teacher "
                         "MODEL (the full-precision model)")
    builtin = recorded.lower() in BUILTIN_MODELS or recorded.lower() == "smollm2"
    hub = bool(HUB_NAME.fullmatch(recorded)) and ".." not in recorded
    if not (builtin or hub) or Path(recorded).expanduser().exists():
        raise UsageError(f"--teacher-from-metadata: the metadata of {ckpt} names {recorded!r}, which is not a "
                         "built-in or hub model name (a local path from metadata is never loaded); pass --teacher "
                         "MODEL")
    return recorded


def _given_teacher(args):
    """--teacher, checked as a model argument; None when not given."""
    if not args.teacher:
        return None
    check_model(args.teacher, "--teacher")
    return args.teacher


def resolve_teacher(args, ckpt: Path) -> str:
    """The teacher of a checkpoint input: --teacher, or with --teacher-from-metadata the recorded name."""
    from ..models.hf import source_model

    if args.teacher and args.teacher_from_metadata:
        raise UsageError("--teacher and --teacher-from-metadata both name the teacher: give one of them")
    teacher = _given_teacher(args)
    if teacher:
        return teacher
    recorded = source_model(ckpt)
    if args.teacher_from_metadata:
        return teacher_from_metadata(ckpt, recorded)
    if recorded is None:
        raise UsageError(f"{ckpt} is a quantized checkpoint: pass the full-precision teacher with --teacher MODEL")
    raise UsageError(f"{ckpt} is a quantized checkpoint: pass the full-precision teacher with --teacher MODEL (its "
                     f"metadata names the source model {recorded!r}; pass --teacher-from-metadata to use that name)")


def resolve_model_teacher(args) -> str:
    """The teacher of a model-name input: --teacher (a model that shares its tokenizer), else the model itself."""
    if args.teacher_from_metadata:
        raise UsageError("--teacher-from-metadata: only with a quantized checkpoint input (its metadata names the "
                         f"source model); {args.model} is a model, its own teacher unless --teacher says otherwise")
    return _given_teacher(args) or args.model


def same_model(a: str, b: str) -> bool:
    """Whether two model arguments name the same model (one name, or paths to one file or directory)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def check_loaded_vocabulary(model: str, teacher: str, student_lm, teacher_lm, compare_tokenizers: bool) -> None:
    """After loading (for what the configs did not say): the teacher's vocabulary is the student's; with
    ``compare_tokenizers`` also their tokenizers' token -> id maps, when both have transformers tokenizers."""
    from ..models.vocabulary import check_same_vocabulary, model_vocab_size

    maps = [None, None]
    if compare_tokenizers:
        toks = [getattr(lm.tokenizer, "hf", None) for lm in (student_lm, teacher_lm)]
        if all(t is not None and hasattr(t, "get_vocab") for t in toks):
            maps = [t.get_vocab() for t in toks]
    check_same_vocabulary(model, teacher, model_vocab_size(student_lm.model), model_vocab_size(teacher_lm.model),
                          *maps)



__all__ = ["HUB_NAME", "check_loaded_vocabulary", "resolve_model_teacher", "resolve_teacher", "same_model",
           "teacher_from_metadata"]
