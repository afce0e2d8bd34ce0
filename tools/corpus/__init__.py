"""Corpora: the synthetic pretraining and federation corpora (the plan of speakers and
texts, speech synthesis, the build through either acoustic simulation and its
figures) and the import of a device maker's own recordings with the phrase locator.
tools/CORPUS.md describes both."""
