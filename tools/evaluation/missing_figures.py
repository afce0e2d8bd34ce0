"""What fills an n/a cell of `wakefl eval`: each reason a figure is missing (a note of
sdk/wake_metrics.py or of the single-model scoring) mapped to the recordings that would
measure it, in the split the evaluation scores."""

from __future__ import annotations

# Reasons, matched by a phrase of their note, first match wins: the note naming both kinds
# of clips comes before those naming one.
_FILLS: tuple[tuple[str, str], ...] = (
    (
        "no wake-word or no other clips",
        "wake-word recordings (label 1) and short other recordings (label 0)",
    ),
    ("no wake-word clips", "wake-word recordings (label 1)"),
    ("no negative streams", "negative recordings of 10 s or more (label 0; kept as streams)"),
    ("no negative clips", "negative recordings shorter than 10 s (label 0)"),
)


def what_fills(reason: str, split: str) -> str | None:
    """The recordings that would fill a cell missing for `reason`, and how they reach the
    `split` scored; None when more recordings are not the answer (an interval the bootstrap
    cannot bound, a saturated rate)."""
    for phrase, recordings in _FILLS:
        if phrase in reason:
            return (
                f"add {recordings} to the {split} split (`wakefl corpus import --split "
                f"{split}`, or '{split}' in the CSV's split column)"
            )
    return None


def with_remedy(reason: str, split: str) -> str:
    """`reason`, followed by what fills it when recordings do."""
    fills = what_fills(reason, split)
    return reason if fills is None else f"{reason}; to measure it, {fills}"
