"""Quick start: speak a sentence with Drama 3, in a cloned voice, three ways.

    python examples/quickstart.py                         # the published model (downloads ~70 GB)
    python examples/quickstart.py --model PATH -o out.wav # any checkpoint folder

1. `generate()` on processor output, with the published serving sampler and a seed;
2. the same through `pipeline("text-to-speech")`;
3. streaming: waveform chunks as frames are produced, with the time to first audio.
"""

import argparse

import torch

from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.pipeline_drama3 import text_to_speech_pipeline
from transformers_drama3.processing_drama3 import Drama3Processor


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fishaudio/drama-3")
    parser.add_argument("-o", "--output", default="quickstart.wav")
    parser.add_argument("--max-frames", type=int, default=None, help="cap the take (frames of ~46 ms)")
    args = parser.parse_args(argv)
    limit = {} if args.max_frames is None else {"max_new_tokens": args.max_frames}

    model = Drama3ForSpeechGeneration.from_pretrained(args.model, dtype=torch.float32).eval()
    processor = Drama3Processor.from_pretrained(args.model)  # tokenizer + S2 codec

    # 1. generate(): one prefill, then one decode step per frame (~21.5 frames per second of audio)
    text = "<|speaker:0|> Hello! [laughs] This is Drama 3, speaking through Hugging Face Transformers."
    inputs = processor(text)
    output = model.generate(**inputs, seed=0, return_dict_in_generate=True, **limit)
    waveform = processor.decode(output.audio_codes[0, : int(output.lengths[0])])
    processor.save_audio(waveform, args.output)
    print(f"1. generate: {int(output.lengths[0])} frames -> {args.output} ({output.finish_reasons[0]})")

    # A reference (transcript + audio) clones a voice: here the take we just made.
    cloned = processor(
        "Now the same voice says something else.", reference_audio=waveform.numpy(), reference_text=text.split("> ", 1)[1]
    )
    again = model.generate(**cloned, seed=1, preset="paper-eval", **limit)
    print(f"   cloned voice: {again.shape[1]} frames")

    # 2. the text-to-speech pipeline
    speaker = text_to_speech_pipeline(model, processor)
    result = speaker("Pipelines work too.", generate_kwargs={"seed": 0, **limit})
    print(f"2. pipeline: {result['audio'].shape[0] / result['sampling_rate']:.2f} s at {result['sampling_rate']} Hz")

    # 3. streaming: chunks of 10, 10, 12, 32, then 64 frames
    chunks = list(model.stream(**processor("Streaming, chunk by chunk."), codec=processor.codec, seed=0, **limit))
    print(f"3. stream: {len(chunks)} chunks, first audio after {chunks[0].elapsed:.3f} s")


if __name__ == "__main__":
    main()
