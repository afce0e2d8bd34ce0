"""`wakefl corpus build` and `wakefl corpus import`."""

from __future__ import annotations

import argparse
import time
from collections import Counter


def _profile_names() -> tuple[str, ...] | None:
    """The corpus profiles, or None on a core install: their recipes import the full
    extra's acoustics, and `--help` must still work there."""
    try:
        from wakefl.tools.corpus.plan import PROFILES
    except ModuleNotFoundError:
        return None
    return tuple(PROFILES)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("corpus", help="build a synthetic corpus or import recordings")
    sub = p.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)

    b = sub.add_parser("build", help="synthesize the five-device-type wake-word corpus")
    b.add_argument("--out", required=True, help="output folder (new, empty, or a previous corpus)")
    b.add_argument("--seed", type=int, default=0, help="same seed and profile give identical files")
    b.add_argument(
        "--profile",
        choices=_profile_names(),
        default="tiny",
        help="corpus size and recipe (default tiny); 'pretrain' is the pretraining corpus, "
        "'pretrain-voices' its add-on of more voices, 'pretrain-timing' its add-on of re-timed "
        "wake phrases (see tools/CORPUS.md)",
    )
    b.add_argument("--phrase", default="hey nova", help="the wake phrase (default: hey nova)")
    b.add_argument(
        "--tts-cache",
        default=None,
        help="speech cache folder (default $WAKEFL_TTS_CACHE, else $WAKEFL_CACHE/tts, else ~/.cache/wakefl/tts)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=_build)

    i = sub.add_parser("import", help="import your own recordings listed in a CSV")
    i.add_argument("--src", required=True, help="folder the CSV's relative paths start from")
    i.add_argument(
        "--manifest",
        required=True,
        help="CSV with the columns path, label, device_type and optionally state, speaker, "
        "split, onset_s, offset_s (onset_s/offset_s: where the wake phrase lies in a long "
        "positive recording; tools/CORPUS.md)",
    )
    i.add_argument("--out", required=True, help="output folder (new, empty, or a failed import's)")
    i.add_argument("--force", action="store_true", help="replace a previous import's output folder")
    i.add_argument(
        "--allow-speaker-leakage",
        action="store_true",
        help="import a speaker listed in more than one split (refused by default)",
    )
    i.add_argument(
        "--split",
        choices=("train", "val", "test"),
        default=None,
        help="the split of every file the CSV gives none: 'test' for recordings meant for "
        "`wakefl eval`, which scores the test split (default: one per speaker drawn by a "
        "hash of its name, 70/15/15 train/val/test, for training)",
    )
    i.add_argument("--max-bad-share", type=float, default=0.1,
                   help="fail when more than this share of files is bad (default 0.1)")  # fmt: skip
    i.add_argument("--stream-min-s", type=float, default=10.0,
                   help="negatives at least this long become streams (default 10)")  # fmt: skip
    i.add_argument("--quiet", action="store_true", help="no progress bars")
    i.set_defaults(func=_import)


def _summary(manifest_path) -> str:
    from wakefl.sdk.manifest import read_manifest

    rows = read_manifest(manifest_path)
    lines = []
    for d in sorted({r.device_type for r in rows}):
        clips = [r for r in rows if r.device_type == d and r.kind == "clip"]
        streams = [r for r in rows if r.device_type == d and r.kind == "stream"]
        per_split = Counter(r.split for r in clips)
        hours = sum(r.duration_s for r in rows if r.device_type == d) / 3600
        lines.append(
            f"  {d}: clips train/val/test {per_split['train']}/{per_split['val']}/{per_split['test']} "
            f"(positives {sum(r.label for r in clips)}), streams {len(streams)} "
            f"({sum(r.duration_s for r in streams) / 60:.1f} min), {hours:.3f} h in all"
        )
    return "\n".join(lines)


def _build(args: argparse.Namespace) -> int:
    from wakefl.tools.corpus.build import build_corpus

    t0 = time.perf_counter()
    manifest = build_corpus(args.out, seed=args.seed, profile=args.profile, phrase=args.phrase,
                            progress=not args.quiet, tts_cache_dir=args.tts_cache)  # fmt: skip
    print(f"corpus written: {manifest} ({time.perf_counter() - t0:.1f} s)")
    print(_summary(manifest))
    return 0


def _import(args: argparse.Namespace) -> int:
    from wakefl.tools.corpus.importer import import_recordings

    res = import_recordings(args.src, args.manifest, args.out, max_bad_share=args.max_bad_share,
                            stream_min_s=args.stream_min_s, progress=not args.quiet, force=args.force,
                            allow_speaker_leakage=args.allow_speaker_leakage,
                            default_split=args.split)  # fmt: skip
    print(f"imported {res.n_ok} of {res.n_rows} files: {res.manifest}")
    if res.drawn_splits:
        print(
            f"{res.drawn_splits} file(s) had no split: each speaker's drawn 70/15/15 "
            "train/val/test, for training; `wakefl eval` scores only test, so to evaluate "
            "on every file import them with --split test"
        )
    if res.bad:
        print(f"{len(res.bad)} bad file(s) listed in {res.report}:")
        for e in res.bad:
            print(f"  line {e['line']}: {e['path'] or '(no path)'}: {e['detail']}")
    print(_summary(res.manifest))
    return 0
