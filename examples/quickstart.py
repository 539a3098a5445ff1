"""Quick start: speak a sentence with Drama 3, in a cloned voice, three ways.

    python examples/quickstart.py                                   # drama3-tiny, bundled, offline
    python examples/quickstart.py --model fishaudio/drama-3 -o out.wav  # the published model (~70 GB)

1. `generate()` on processor output, with the published serving sampler and a seed;
2. the same through `pipeline("text-to-speech")`;
3. streaming: waveform chunks as frames are produced, with the time to first audio.
"""

import argparse

import torch

from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.pipeline_drama3 import text_to_speech_pipeline
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.tiny import shipped


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or Hub repo (default: the bundled drama3-tiny)")
    parser.add_argument("-o", "--output", default="quickstart.wav")
    parser.add_argument("--max-frames", type=int, default=None, help="cap the take (frames of ~46 ms)")
    args = parser.parse_args(argv)
    limit = {} if args.max_frames is None else {"max_new_tokens": args.max_frames}

    # drama3-tiny (no --model) was trained on cloning rows only: give it one of its bundled voices
    source = args.model or shipped.TINY_MODEL_PATH
    voice = {} if args.model else dict(zip(("reference_audio", "reference_text"), map(lambda x: [x], shipped.reference_voice("A"))))
    model = Drama3ForSpeechGeneration.from_pretrained(source, dtype=torch.float32).eval()
    processor = Drama3Processor.from_pretrained(source)  # tokenizer + codec

    # 1. generate(): one prefill, then one decode step per frame (~21.5 frames per second of audio)
    text = (
        "<|speaker:0|> Hello! [laughs] This is Drama 3, speaking through Hugging Face Transformers."
        if args.model else "<|speaker:0|> Hello there, this is the tiny model speaking."
    )
    inputs = processor(text, **voice)
    # codec=: the take's waveform; return_dict_in_generate: GenerationMixin's output (sequences: the
    # prompt rows then one [main_id, c0..c9] row per step) with the takes and what the guards found
    output = model.generate(**inputs, seed=0, codec=processor.codec, return_dict_in_generate=True, **limit)
    waveform = output.audio[0].float().cpu()
    processor.save_audio(waveform, args.output)
    steps = output.sequences.shape[1] - inputs["input_ids"].shape[1]
    print(f"1. generate: {int(output.lengths[0])} frames in {steps} steps -> {args.output} ({output.finish_reasons[0]})")

    # A reference (transcript + audio) clones a voice: here the take we just made.
    cloned = processor(
        "Now the same voice says something else.", reference_audio=waveform.numpy(), reference_text=text.split("> ", 1)[1]
    )
    again = model.generate(**cloned, seed=1, preset="paper-eval", **limit)
    print(f"   cloned voice: {again.shape[1]} frames")

    # 2. the text-to-speech pipeline
    speaker = text_to_speech_pipeline(model, processor)
    request = "Pipelines work too."
    if voice:  # a chat in the Hugging Face audio format: speaker 0's reference (words + audio), then the line
        request = [
            {"role": "0", "content": [{"type": "text", "text": voice["reference_text"][0]},
                                      {"type": "audio", "path": voice["reference_audio"][0]}]},
            {"role": "0", "content": request},
        ]
    result = speaker(request, generate_kwargs={"seed": 0, **limit})
    print(f"2. pipeline: {result['audio'].shape[0] / result['sampling_rate']:.2f} s at {result['sampling_rate']} Hz")

    # 3. streaming: chunks of 10, 10, 12, 32, then 64 frames
    chunks = list(model.stream(**processor("Streaming, chunk by chunk.", **voice), codec=processor.codec, seed=0, **limit))
    print(f"3. stream: {len(chunks)} chunks, first audio after {chunks[0].elapsed:.3f} s")


if __name__ == "__main__":
    main()
