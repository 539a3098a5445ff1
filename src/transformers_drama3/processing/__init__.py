"""The jobs of `Drama3Processor` (`processing_drama3`), one module each, mixed into the class there.

- `audio_in`: clips (codes, waveforms, files) -> checked codes through the feature extractor and
  the codec; the checks every reference passes.
- `rows`: requests (raw text, scripts) -> padded model rows and their layout metadata, and back.
- `chat_template`: conversations in the Hugging Face audio style -> scripts -> rows.
- `audio_out`: generated codes -> waveforms through the codec, and audio files.
- `saved_codec`: the codec saved beside a processor, found and loaded.
"""
