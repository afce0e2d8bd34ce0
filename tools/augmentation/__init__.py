"""What training does to a window before the model sees it: waveform augmentation, speech
behind and around the talker, and spectrogram-level warps and masks. Pure numpy/torch
functions, deterministic for a given generator; the training loop calls them."""
