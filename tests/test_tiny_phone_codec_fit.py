"""The phonetic codec's recipe: frame labels, training windows equal to what the codec reads,
training that learns and resumes exactly, export."""

import json

import numpy as np
import pytest
import torch

from recipes.drama3_tiny import phone_codec_fit as fit
from recipes.drama3_tiny.corpus import VOICES_BY_NAME


def test_frame_labels_follow_the_phoneme_starts_and_the_silence():
    hop = fit.HOP
    samples = np.zeros(20 * hop, dtype=np.int16)
    samples[2 * hop : 9 * hop] = 3000  # sound, then silence from hop 9 on
    samples[12 * hop : 16 * hop] = 3000
    phonemes = [("_", 0), ("a", 2 * hop), ("b", 5 * hop), ("c", 12 * hop), ("_", 16 * hop)]
    labels = fit.frame_labels(samples, phonemes, frames=20)
    # frame j is centred on sample 256 j - 256: frame 3 on the start of "a", frame 10 on the last
    # loud sample; the 256 samples around a centre decide whether it is silent
    assert labels[:3] == ["_"] * 3
    assert labels[3:6] == ["a"] * 3 and labels[6:11] == ["b"] * 5
    assert labels[11:13] == ["_"] * 2  # "b" has ended in silence
    assert labels[13:17] == ["c"] * 4 and labels[17:] == ["_"] * 3


def test_voice_labels_name_variant_pitch_and_whisper():
    voice = VOICES_BY_NAME["A"]
    assert fit.voice_label("Hello there.", voice) == "m1 p50"
    assert fit.voice_label("(high) Hello there.", voice) == "m1 p75"
    assert fit.voice_label("Hello <whisper>there.</whisper>", voice) == "m1 p50 whisper"


def test_the_labelled_utterances_spread_over_every_voice_of_the_manifest():
    manifest = [f"{voice}-{i}" for voice in "ABDF" for i in range(6000)]  # a corpus lists voice after voice
    chosen = fit.spread(manifest, 8000)
    assert len(chosen) == len(set(chosen)) == 8000
    assert {voice: sum(c.startswith(voice) for c in chosen) for voice in "ABDF"} == dict.fromkeys("ABDF", 2000)
    assert fit.spread(manifest[:10], 20) == manifest[:10]


def test_a_tagged_label_run_adds_other_utterances_of_the_voices_asked_for(tmp_path):
    """`label --voices A --tag more` into a labelled folder: shards labels-more-*.pt of voice A's
    train utterances that the folder's first shards do not hold; `read_labels` reads them all."""
    from recipes.drama3_tiny.corpus import build_corpus, read_manifest

    build_corpus(tmp_path / "corpus", seed=3, utterances_per_voice=4, heldout_sentences=2,
                 voices=[VOICES_BY_NAME["A"], VOICES_BY_NAME["B"]], progress=False)
    train = [r for r in read_manifest(tmp_path / "corpus" / "manifest.jsonl") if r.split == "train"]
    first = fit.label(tmp_path / "corpus", tmp_path / "labels", utterances=4)
    assert [p.name for p in first] == ["labels-00-of-01.pt"]
    firsts = {row["id"] for row in torch.load(first[0], weights_only=False)}
    added = fit.label(tmp_path / "corpus", tmp_path / "labels", utterances=100, voices=["A"], tag="more")
    assert [p.name for p in added] == ["labels-more-00-of-01.pt"]
    more = {row["id"] for row in torch.load(added[0], weights_only=False)}
    assert more == {r.id for r in train if r.voice == "A"} - firsts and more
    assert {row["id"] for row in fit.read_labels(tmp_path / "labels")} == firsts | more
    with pytest.raises(ValueError, match="letters only"):
        fit.label(tmp_path / "corpus", tmp_path / "labels", utterances=1, tag="../x")


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Two labelled utterances spoken by libespeak-ng, with their audio."""
    from transformers_drama3.codec import Drama3MelCodecConfig, Drama3MelCodecModel

    analysis = Drama3MelCodecModel(Drama3MelCodecConfig()).eval()
    items = [("u0", "The bucket is in the back garden.", "A"), ("u1", "(slow) Room? [pause] Yes.", "D")]
    rows = [fit.label_utterance(analysis, uid, text, VOICES_BY_NAME[v]) for uid, text, v in items]
    audio = [fit.aligned_segments_synthesize(text, VOICES_BY_NAME[v])[0] for _, text, v in items]
    folder = tmp_path_factory.mktemp("labels")
    torch.save(rows, folder / "labels-00-of-01.pt")
    return rows, audio, folder


def test_labels_cover_every_frame_with_the_spoken_phonemes(labelled):
    rows, audio, _ = labelled
    for row, samples in zip(rows, audio):
        frames = -(-len(samples) // 1024) * 4
        assert len(row["labels"]) == frames and row["log_mel"].shape == (80, frames + 4)
        spoken = [label for label in row["labels"] if label != "_"]
        assert len(set(spoken)) >= 5 and row["labels"][0] == "_" and row["labels"][-1] == "_"
    assert rows[0]["voice"] == "m1 p50" and rows[1]["voice"] == "f4 p55"


def test_training_windows_are_what_the_codec_reads(labelled):
    """A training crop over a whole utterance gives the recogniser the log-mel `encode` gives it,
    and the decoder the labels `decode` gives it."""
    rows, audio, _ = labelled
    codec = fit.new_codec(rows, hidden_size=16, dilations=[1, 2, 4]).eval()
    data = fit.indexed(rows, codec.config)
    for index, samples in enumerate(audio):
        frames = len(data[index][0])
        phonemes, voices, log_mel = fit.batch([data[index]], codec.config, step=0, seed=0, size=1, frames=frames)
        encoded = codec.encode(samples.astype(np.float32) / 32768, sampling_rate=22050).audio_codes
        # the labels store the log-mel in float16: codes of a near tie may differ, nearly all agree
        agreement = (codec.encode_log_mel(log_mel) == encoded).float().mean()
        assert codec.encode_log_mel(log_mel).shape == encoded.shape and agreement > 0.95
        m = codec.config.mel_frames_per_frame
        left, right = codec.config.receptive_field
        labels = phonemes[0, left : left + frames].reshape(-1, m)
        true_codes = torch.cat([labels[:, :1], torch.full((len(labels), 1), data[index][1]), labels[:, 1:]], 1).T[None]
        with torch.no_grad():
            torch.testing.assert_close(codec.decode_labels(phonemes, voices), codec.dequantize(true_codes),
                                       rtol=1e-5, atol=1e-5)


def test_spectral_convergence_weighs_the_loud_bands_and_adds_to_the_decoders_loss(labelled):
    """The same log-mel error costs the spectral convergence more in a loud band than in a quiet
    one (the log-mel L1 sees them alike); it is 0 on the target and the same at any loudness; the
    decoder's loss with a weight is its L1 plus the weight times it."""
    target = torch.full((2, 6, 10), -6.0)
    target[:, 1] = 0.0  # one loud band
    loud, quiet = target.clone(), target.clone()
    loud[:, 1] += 0.3
    quiet[:, 4] += 0.3
    torch.testing.assert_close((loud - target).abs().mean(), (quiet - target).abs().mean())
    assert fit.spectral_convergence(loud, target) > 50 * fit.spectral_convergence(quiet, target)
    assert float(fit.spectral_convergence(target, target)) == 0.0
    torch.testing.assert_close(fit.spectral_convergence(loud + 2.0, target + 2.0), fit.spectral_convergence(loud, target))
    rows, _, _ = labelled
    codec = fit.new_codec(rows, hidden_size=16, dilations=[1, 2, 4])
    crops = fit.batch(fit.indexed(rows, codec.config), codec.config, step=0, seed=0, size=2, frames=40, part="decoder")
    plain, _ = fit.train_step_loss(codec, "decoder", *crops)
    weighted, _ = fit.train_step_loss(codec, "decoder", *crops, spectral_convergence_weight=0.5)
    left, right = codec.config.decoder_receptive_field
    predicted = codec.decode_labels(crops[0], crops[1])
    expected = plain + 0.5 * fit.spectral_convergence(predicted, crops[2][..., left : crops[2].shape[-1] - right])
    torch.testing.assert_close(weighted, expected)


def test_training_learns_resumes_exactly_and_exports(labelled, tmp_path):
    import json

    from transformers import AutoModel

    import transformers_drama3  # noqa: F401  (registers the codec types)

    _, audio, folder = labelled
    sizes = dict(max_steps=60, minutes=10, learning_rate=3e-3, batch_size=2, frames=24, progress=False, log_every=10)
    fit.train(folder, tmp_path / "straight", "decoder", **sizes)
    log = [json.loads(line) for line in (tmp_path / "straight" / "decoder.jsonl").read_text().splitlines()]
    assert [line["step"] for line in log] == [10, 20, 30, 40, 50, 60]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]  # it learns
    # stopped at step 25 and resumed: the same weights and optimizer state, bit for bit
    fit.train(folder, tmp_path / "resumed", "decoder", stop_at=25, **sizes)
    assert torch.load(tmp_path / "resumed" / "decoder.pt", weights_only=False)["step"] == 25
    fit.train(folder, tmp_path / "resumed", "decoder", resume=True, **sizes)
    straight = torch.load(tmp_path / "straight" / "decoder.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "decoder.pt", weights_only=False)
    assert resumed["step"] == straight["step"] == 60
    for name, tensor in straight["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
    with pytest.raises(FileExistsError, match="--resume"):
        fit.train(folder, tmp_path / "straight", "decoder", **sizes)

    recogniser = fit.train(folder, tmp_path / "straight", "recogniser", **sizes)
    assert recogniser["frame_accuracy"] > 0.3  # of ~30 labels, on two utterances
    codec = AutoModel.from_pretrained(fit.export(folder, tmp_path / "straight")).eval()
    assert codec.config.model_type == "drama3_phone_codec" and codec.config.phonemes[0] == "_"
    for name, tensor in straight["state"].items():
        assert torch.equal(codec.state_dict()[name], tensor), name
    codes = codec.encode(audio[0].astype(np.float32) / 32768, sampling_rate=22050).audio_codes
    assert codes.shape[1] == 5 and codec.decode(codes).audio_values.shape[-1] == codes.shape[-1] * 1024


def test_a_fine_tune_starts_from_a_trained_half_and_learns_only_the_voices_asked_for(labelled, tmp_path):
    """`train --init-from RUN/decoder.pt --voices A`: the first step starts from the given weights,
    batches hold only voice A's utterances, and the codec's labels stay those of every voice."""
    rows, _, _ = labelled
    named = [dict(row, id=f"{voice}-train-{i:05d}") for i, (row, voice) in enumerate(zip(rows, "AD"))]
    folder = tmp_path / "labels"
    folder.mkdir()
    torch.save(named, folder / "labels-00-of-01.pt")
    sizes = dict(minutes=10, learning_rate=3e-3, batch_size=2, frames=24, progress=False, log_every=5)
    fit.train(folder, tmp_path / "all", "decoder", max_steps=10, **sizes)
    trained = torch.load(tmp_path / "all" / "decoder.pt", weights_only=False)

    seen = []
    original_batch = fit.batch
    fit.batch = lambda data, *args: seen.append(len(data)) or original_batch(data, *args)
    try:
        fit.train(folder, tmp_path / "tuned", "decoder", max_steps=1, voices=["A"],
                  init_from=tmp_path / "all" / "decoder.pt", **{**sizes, "learning_rate": 0.0})
    finally:
        fit.batch = original_batch
    assert seen == [1]  # one utterance of voice A
    tuned = torch.load(tmp_path / "tuned" / "decoder.pt", weights_only=False)
    assert tuned["step"] == 1 and tuned["config"] == trained["config"]  # labels of both voices kept
    for name, tensor in trained["state"].items():  # a zero learning rate leaves the start as it was
        assert torch.equal(tuned["state"][name], tensor), name
    with pytest.raises(ValueError, match="no labelled utterance"):
        fit.train(folder, tmp_path / "none", "decoder", max_steps=1, voices=["B"], **sizes)
    changed = dict(trained, config={**trained["config"], "voices": trained["config"]["voices"][::-1]})
    torch.save(changed, tmp_path / "other-voices.pt")
    with pytest.raises(ValueError, match="its voices differ from those of"):
        fit.train(folder, tmp_path / "relabelled", "decoder", max_steps=1, init_from=tmp_path / "other-voices.pt", **sizes)
    with pytest.raises(ValueError, match="not a recogniser checkpoint"):
        fit.train(folder, tmp_path / "wrong", "recogniser", max_steps=1, init_from=tmp_path / "all" / "decoder.pt",
                  **sizes)


def test_a_decoder_grown_from_a_checkpoint_starts_from_its_output(labelled, tmp_path):
    """`train --init-from RUN/decoder.pt --decoder-dilations ... --decoder-lookahead ...`: the
    checkpoint's layers keep their weights, the layers after them start as the identity, so the
    grown decoder's log-mel equals the checkpoint's on the same labels; a resume with other sizes
    and a checkpoint that is not the first layers are refused."""
    rows, _, folder = labelled
    sizes = dict(minutes=10, batch_size=2, frames=24, progress=False, log_every=5)
    fit.train(folder, tmp_path / "small", "decoder", max_steps=3, learning_rate=3e-3, **sizes)
    grown_sizes = dict(decoder_dilations=fit.integers("1,2,4,8,1,2,4,8,16"),
                       decoder_lookahead=fit.lookahead_argument("4,4,4,4,4,4,4,4,16"))
    assert grown_sizes["decoder_lookahead"] == [4] * 8 + [16] and fit.lookahead_argument("8") == 8
    fit.train(folder, tmp_path / "grown", "decoder", max_steps=1, learning_rate=0.0,
              init_from=tmp_path / "small" / "decoder.pt", **grown_sizes, **sizes)
    small, grown = fit.new_codec(rows).eval(), fit.new_codec(rows, **grown_sizes).eval()
    small.load_state_dict(torch.load(tmp_path / "small" / "decoder.pt", weights_only=False)["state"], strict=False)
    grown.load_state_dict(torch.load(tmp_path / "grown" / "decoder.pt", weights_only=False)["state"], strict=False)
    assert len(grown.decoder.layers) == 9 and grown.decoder.layers[8].mix.weight.abs().sum() == 0
    phonemes, voices, _ = fit.batch(fit.indexed(rows, grown.config), grown.config, 0, 0, 2, 24, "decoder")
    (left, right), (small_left, small_right) = grown.config.decoder_receptive_field, small.config.decoder_receptive_field
    assert (left, right) == (small_left + 48, small_right + 16)
    inner = slice(left - small_left, phonemes.shape[-1] - (right - small_right))
    with torch.no_grad():
        expected = small.decode_labels(phonemes[:, inner], voices[:, inner])
        torch.testing.assert_close(grown.decode_labels(phonemes, voices), expected, rtol=0, atol=1e-6)
    assert expected.std() > 0.01  # a trained decoder's varying output, not a constant
    with pytest.raises(ValueError, match="resume with the sizes it was started with"):
        fit.train(folder, tmp_path / "small", "decoder", max_steps=4, learning_rate=3e-3, resume=True,
                  **grown_sizes, **sizes)
    with pytest.raises(ValueError, match="is not the first layers of"):
        fit.train(folder, tmp_path / "other", "decoder", max_steps=1, init_from=tmp_path / "small" / "decoder.pt",
                  decoder_dilations=[2, 2, 4, 8, 1, 2, 4, 8, 16], learning_rate=0.0, **sizes)


def test_labelling_a_sentences_file_speaks_each_sentence_in_each_voice(tmp_path):
    """`label --sentences FILE --voices A,B --utterances 2`: the file's first two sentences (comments
    and blank lines skipped), each in A then B, labelled exactly as a corpus utterance is; two jobs
    write the same rows as one; a bad file, voice or source is refused before any speech."""
    from transformers_drama3.codec import Drama3MelCodecConfig, Drama3MelCodecModel

    sentences = tmp_path / "sentences.txt"
    sentences.write_text("# everyday sentences\nThe tea is hot.\n\nCall me at noon.\nNot this one.\n", encoding="utf-8")
    one = fit.read_labels(fit.label(None, tmp_path / "one", 2, voices=["A", "B"], sentences=sentences)[0].parent)
    assert [(row["id"], row["text"]) for row in one] == [
        ("A-everyday-00000", "The tea is hot."), ("B-everyday-00000", "The tea is hot."),
        ("A-everyday-00001", "Call me at noon."), ("B-everyday-00001", "Call me at noon.")]
    assert [fit.corpus_voice(row["id"]) for row in one] == ["A", "B", "A", "B"]
    analysis = Drama3MelCodecModel(Drama3MelCodecConfig()).eval()
    assert one[3]["voice"] == "f2 p65"
    # voice A repeats bit for bit (B's espeak variant draws breath noise afresh: compared below)
    expected = fit.label_utterance(analysis, "A-everyday-00001", "Call me at noon.", VOICES_BY_NAME["A"])
    assert one[2]["labels"] == expected["labels"] and one[2]["voice"] == expected["voice"] == "m1 p50"
    assert torch.equal(one[2]["log_mel"], expected["log_mel"])
    # two jobs write the same utterances with the same labels; the speech of A repeats bit for bit, and
    # B's within the breath noise its espeak variant (f2) draws afresh each time
    shards = fit.label(None, tmp_path / "two", 2, jobs=2, voices=["A", "B"], sentences=sentences)
    assert [path.name for path in shards] == ["labels-00-of-02.pt", "labels-01-of-02.pt"]
    two = {row["id"]: row for row in fit.read_labels(tmp_path / "two")}
    assert sorted(two) == sorted(row["id"] for row in one)
    for row in one:
        assert two[row["id"]]["labels"] == row["labels"]
        difference = (two[row["id"]]["log_mel"].float() - row["log_mel"].float()).abs().mean()
        assert difference == 0 if row["id"].startswith("A") else difference < 0.2, (row["id"], difference)
    (tmp_path / "empty.txt").write_text("# nothing\n\n", encoding="utf-8")
    for call, message in [
        (lambda: fit.label(None, tmp_path / "x", 2, voices=["A"], sentences=tmp_path / "empty.txt"), "no sentences"),
        (lambda: fit.label(None, tmp_path / "x", 2, voices=["A", "Q"], sentences=sentences), "unknown"),
        (lambda: fit.label(None, tmp_path / "x", 2, sentences=sentences), "needs the voices"),
        (lambda: fit.label(tmp_path, tmp_path / "x", 2, voices=["A"], sentences=sentences), "either a corpus"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    assert not (tmp_path / "x").exists()


def test_the_recognised_codes_a_decoder_fine_tune_reads_are_those_decode_reads(labelled):
    """`recognised_rows`: per spectrogram frame the phoneme and voice the codec's recogniser writes
    for the row's speech (its codes from the audio, but for near ties of the float16 log-mel); a
    crop over a whole row gives the decoder exactly what `decode` gives it for those codes."""
    rows, audio, _ = labelled
    codec = fit.new_codec(rows, hidden_size=16, dilations=[1, 2, 4]).eval()
    data = fit.recognised_rows(codec, [rows[0], rows[1], rows[0]])
    assert len(data) == 3 and data[2] is data[0]  # a repeated row is read once
    left, right = codec.config.receptive_field
    for (phonemes, voices, log_mel), samples in zip(data, audio):
        assert phonemes.shape == voices.shape == (log_mel.shape[-1] - 4,)
        from_audio = codec.code_frames(codec.encode(samples.astype(np.float32) / 32768, sampling_rate=22050).audio_codes)
        assert (from_audio[0][0] == phonemes).float().mean() > 0.95 and (from_audio[1][0] == voices).float().mean() > 0.95
        padded = torch.cat([codec.silent_log_mel(1, left)[0], log_mel, codec.silent_log_mel(1, right - 4)[0]], -1)
        codes = codec.encode_log_mel(padded[None])
        crop = fit.batch([(phonemes, voices, log_mel)], codec.config, 0, 0, 1, len(phonemes), "decoder")
        with torch.no_grad():
            torch.testing.assert_close(codec.decode_labels(crop[0], crop[1]), codec.dequantize(codes),
                                       rtol=1e-5, atol=1e-5)


def test_a_decoder_fine_tune_of_a_saved_codec_resumes_exactly_and_keeps_the_recogniser(labelled, tmp_path):
    """`finetune --codec FOLDER --extra-labels ... --voices A`: batches hold the voice's utterances
    and the extra ones repeated (an utterance with a phoneme the codec lacks left out); stopped
    and resumed it ends with the same weights bit for bit; RUN/codec appears when it is done, with
    the new decoder and the recogniser it started with."""
    from transformers import AutoModel

    rows, _, _ = labelled
    named = [dict(row, id=f"{voice}-train-{i:05d}") for i, (row, voice) in enumerate(zip(rows, "AD"))]
    extra = [dict(rows[0], id="A-everyday-00000"), dict(rows[0], id="A-everyday-00001", labels=["ʘ"] + rows[0]["labels"][1:])]
    for name, content in (("labels", named), ("extra", extra)):
        (tmp_path / name).mkdir()
        torch.save(content, tmp_path / name / "labels-00-of-01.pt")
    start = fit.new_codec(rows, hidden_size=16, dilations=[1, 2, 4]).eval()
    start.save_pretrained(tmp_path / "codec")
    sizes = dict(max_steps=30, minutes=10, learning_rate=3e-3, batch_size=2, frames=24, progress=False, log_every=10,
                 extra_labels=tmp_path / "extra", extra_repeat=2, voices=["A"])
    seen = []
    original_batch = fit.batch
    fit.batch = lambda data, *args: seen.append(len(data)) or original_batch(data, *args)
    try:
        fit.finetune_decoder(tmp_path / "codec", tmp_path / "labels", tmp_path / "straight", **sizes)
    finally:
        fit.batch = original_batch
    assert set(seen) == {3}  # A's corpus utterance and the known everyday one twice
    fit.finetune_decoder(tmp_path / "codec", tmp_path / "labels", tmp_path / "resumed", stop_at=12, **sizes)
    assert not (tmp_path / "resumed" / "codec").exists()
    fit.finetune_decoder(tmp_path / "codec", tmp_path / "labels", tmp_path / "resumed", resume=True, **sizes)
    straight = torch.load(tmp_path / "straight" / "decoder.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "decoder.pt", weights_only=False)
    for name, tensor in straight["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
    tuned = AutoModel.from_pretrained(tmp_path / "resumed" / "codec").eval()
    for name, tensor in start.state_dict().items():
        part = "decoder" if name.split(".")[0] in fit.PARTS["decoder"] else "recogniser"
        if part == "recogniser":
            assert torch.equal(tuned.state_dict()[name], tensor), name
        else:
            assert torch.equal(tuned.state_dict()[name], straight["state"][name]), name
    assert not torch.equal(tuned.decoder_output.weight, start.decoder_output.weight)
    log = [json.loads(line) for line in (tmp_path / "straight" / "decoder.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]  # it learns
    with pytest.raises(ValueError, match="'recognised' or 'labels'"):
        fit.finetune_decoder(tmp_path / "codec", tmp_path / "labels", tmp_path / "x", codes="phones", **sizes)
    with pytest.raises(ValueError, match="that the codec can say"):
        fit.finetune_decoder(tmp_path / "codec", tmp_path / "labels", tmp_path / "x", **{**sizes, "voices": ["B"]})


@pytest.mark.skipif(not __import__("recipes.drama3_tiny.corpus", fromlist=["x"]).espeak_available(),
                    reason="espeak-ng binary not on PATH")
def test_the_language_model_recipe_trains_and_speaks_with_the_phonetic_codec(labelled, tmp_path):
    """`lm_training` takes a phonetic codec folder: five codes a frame, the model and processor
    saved with it, generation in its layout (with the recipe's two levers for such a codec on:
    semantic tokens seeded from their phonemes, the guided-attention loss on the alignment read off
    the codes, every code of a frame fused into the backbone's input)."""
    from transformers import AutoModel, AutoProcessor

    from recipes.drama3_tiny.corpus import build_corpus
    from recipes.drama3_tiny.lm_training import main
    from transformers_drama3.codec import Drama3PhoneCodecModel

    rows, _, _ = labelled
    fit.new_codec(rows, hidden_size=16, dilations=[1, 2]).save_pretrained(tmp_path / "codec")
    build_corpus(tmp_path / "corpus", seed=3, utterances_per_voice=4, heldout_sentences=10,
                 voices=[VOICES_BY_NAME["A"]], progress=False)
    main(["--corpus", str(tmp_path / "corpus"), "--codec", str(tmp_path / "codec"), "--out", str(tmp_path / "run"),
          "--batch-size", "2", "--warmup-steps", "1", "--save-steps", "2", "--threads", "1", "--max-steps", "2",
          "--text-frontend", "phonemes", "--seed-phoneme-codes", "--guided-attention", "1.0",
          "--guided-attention-target", "aligned", "--codebook-fusion", "4"])
    model = AutoModel.from_pretrained(tmp_path / "run" / "model").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "run" / "model")
    assert isinstance(processor.codec, Drama3PhoneCodecModel) and model.config.num_codebooks == 5
    assert model.config.audio_decoder_config.vq_backbone_codebooks == 4  # every sub-frame phoneme reaches the backbone
    inputs = processor("A short test.", reference_audio=[str(tmp_path / "corpus" / "wavs" / "A-train-00000.wav")],
                       reference_text=["reference words"], sampling_rate=None)
    codes = model.generate(**inputs, seed=0, max_new_tokens=4)
    assert codes.shape[0] == 1 and codes.shape[-1] == 5
    audio = processor.codec.decode(codes[0].T[None]).audio_values
    assert audio.shape[-1] == codes.shape[1] * 1024


@pytest.mark.skipif(not __import__("recipes.drama3_tiny.corpus", fromlist=["x"]).espeak_available(),
                    reason="espeak-ng binary not on PATH")
def test_a_second_process_encoding_from_the_end_fills_the_runs_codes_cache(labelled, tmp_path):
    """`lm_training --encode-from-end` encodes the far half of the corpus into RUN/codes and trains
    nothing; the run's own encoding then reads those utterances from the cache, the same codes as
    encoding them itself."""
    from recipes.drama3_tiny.corpus import build_corpus
    from recipes.drama3_tiny.lm_training import corpus_records, far_half, load_codec, main
    from transformers_drama3.training import prepare_dataset

    rows, _, _ = labelled
    fit.new_codec(rows, hidden_size=16, dilations=[1, 2]).save_pretrained(tmp_path / "codec")
    build_corpus(tmp_path / "corpus", seed=5, utterances_per_voice=5, heldout_sentences=10,
                 voices=[VOICES_BY_NAME["B"]], progress=False)
    main(["--corpus", str(tmp_path / "corpus"), "--codec", str(tmp_path / "codec"), "--out", str(tmp_path / "run"),
          "--encode-from-end"])
    records, codec = corpus_records(tmp_path / "corpus"), load_codec(tmp_path / "codec")
    assert len(list((tmp_path / "run" / "codes").glob("*.npy"))) == len(far_half(records)) < len(records)
    assert not (tmp_path / "run" / "model").exists()
    cached, report = prepare_dataset(records, codec, tmp_path / "run" / "codes", progress=False)
    assert report.from_cache == len(far_half(records)) and report.kept == len(records)
    fresh, _ = prepare_dataset(records, codec, tmp_path / "fresh", progress=False)
    assert cached["codes"] == fresh["codes"]


def test_semantic_tokens_start_as_the_text_tokens_of_their_phonemes(labelled):
    """`seed_phoneme_codes`: every phoneme the labels use has text tokens (the codec's labels and
    the phoneme front end spell phonemes alike), and each semantic token starts as their mean."""
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, seed_phoneme_codes, tiny_model_config
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.prompting import semantic_token
    from transformers_drama3.prompting.phonemes import phoneme_token

    rows, _, _ = labelled
    config = fit.codec_config(rows)
    tokenizer = build_tiny_tokenizer(["The bucket is in the back garden.", "Room? Yes."], config.codebook_size,
                                     text_frontend="phonemes")
    torch.manual_seed(0)
    model = Drama3ForSpeechGeneration(tiny_model_config(tokenizer, config.num_codebooks, config.codebook_size,
                                                        hidden_size=32, tower_intermediate_size=32))
    before = model.get_input_embeddings().weight.detach().clone()
    codebooks_before = model.audio_decoder.codebook_embeddings.weight.detach().clone()
    assert seed_phoneme_codes(model, tokenizer, config.phonemes, codebooks=[2, 3]) == len(config.phonemes)
    table, vocabulary = model.get_input_embeddings().weight, tokenizer.get_vocab()
    silence = vocabulary[semantic_token(0)]
    torch.testing.assert_close(table[silence], before[vocabulary[phoneme_token(" ")]])
    spoken = [p for p in config.phonemes[1:] if "ˈ" not in p and "ˌ" not in p and len(p) == 1]
    assert spoken
    for phoneme in spoken:
        code = vocabulary[semantic_token(config.phonemes.index(phoneme))]
        torch.testing.assert_close(table[code], before[vocabulary[phoneme_token(phoneme)]])
    untouched = vocabulary[semantic_token(len(config.phonemes))]
    assert torch.equal(table[untouched], before[untouched])
    # the sub-frame codebooks asked for start like the semantic tokens (what partial codebook fusion
    # adds to an audio row); the voice codebook and the others keep their random start
    codebooks, size = model.audio_decoder.codebook_embeddings.weight, config.codebook_size
    for code in range(len(config.phonemes)):
        for codebook in (2, 3):
            torch.testing.assert_close(codebooks[codebook * size + code], table[vocabulary[semantic_token(code)]])
    for codebook in (0, 1, 4):
        block = slice(codebook * size, (codebook + 1) * size)
        assert torch.equal(codebooks[block], codebooks_before[block])
