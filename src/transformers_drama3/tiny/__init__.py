"""drama3-tiny groundwork: a synthetic directed-speech corpus (espeak-ng) and the instruments that
judge speech offline (pocketsphinx WER, resemblyzer speaker similarity, MFCC + DTW content test).

Submodules import their optional dependencies lazily: `corpus` needs the `espeak-ng` binary,
`instruments.transcribe` needs pocketsphinx and `instruments.speaker_embedding` resemblyzer.
"""
