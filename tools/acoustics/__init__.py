"""How a device hears a room: the training simulator of the device types A-E (room
impulses, background sounds, microphone and converter) and the second, held-out
simulation (image-source rooms, gain control, noise suppression, narrowband links)
that checkpoints and thresholds are chosen on, with its training augmentation."""
