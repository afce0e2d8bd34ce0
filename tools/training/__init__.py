"""Offline training of the wake-word model: pretraining (the loop, its settings, data,
validation, checkpoints and publishing), the augmentations it draws (waveform,
spectrum and time warps), hard-negative mining and the warm-start baseline."""
