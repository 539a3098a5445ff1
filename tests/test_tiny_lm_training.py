"""The drama3-tiny pipeline end to end on a miniature corpus: espeak corpus -> fitted log-mel codec
-> `lm_training` (Trainer, resumable) -> a model folder `from_pretrained` reads -> export into a
package folder with bundled voices."""

import json
import shutil

import pytest
import torch

from recipes.drama3_tiny.corpus import build_corpus, espeak_available, VOICES_BY_NAME
from recipes.drama3_tiny.lm_recipe import TINY_REPETITION_AWARE, TINY_TEMPERATURE

pytestmark = pytest.mark.skipif(not espeak_available(), reason="espeak-ng binary not on PATH")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    build_corpus(folder, seed=3, utterances_per_voice=8, heldout_sentences=10,
                 voices=[VOICES_BY_NAME["A"], VOICES_BY_NAME["B"]], progress=False)
    return folder


@pytest.fixture(scope="module")
def codec_dir(corpus, tmp_path_factory):
    from recipes.drama3_tiny.mel_codec_fit import fit_codec

    folder = tmp_path_factory.mktemp("codec")
    fit_codec(corpus, num_codebooks=2, codebook_size=16, iterations=3, progress=False).save_pretrained(folder)
    return folder


def run_training(corpus, codec_dir, out, *extra):
    from recipes.drama3_tiny.lm_training import main

    main(["--corpus", str(corpus), "--codec", str(codec_dir), "--out", str(out), "--batch-size", "2",
          "--warmup-steps", "1", "--save-steps", "2", "--logging-steps", "1", "--threads", "1", *extra])


@pytest.mark.slow
def test_training_runs_resumes_and_writes_a_loadable_model(corpus, codec_dir, tmp_path):
    from transformers import AutoModel, AutoProcessor

    from transformers_drama3.codec import Drama3MelCodecModel

    out = tmp_path / "run"
    # a backbone-only stage (codebook loss weight 0: no tower) stopped after step 2 of 4, then the
    # full loss on resume
    run_training(corpus, codec_dir, out, "--max-steps", "4", "--stop-at", "2", "--codebook-loss-weight", "0")
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    first = [json.loads(line) for line in open(out / "losses.jsonl")]
    from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration

    tower_before = Drama3ForSpeechGeneration.from_pretrained(out / "checkpoint-2").state_dict()
    run_training(corpus, codec_dir, out, "--max-steps", "4", "--resume",
                 "--semantic-loss-weight", "1.0", "--codebook-loss-weight", "0.25")
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # continued from checkpoint-2, not from scratch
    tower_after = Drama3ForSpeechGeneration.from_pretrained(out / "checkpoint-4").state_dict()
    tower_keys = [k for k in tower_before if k.startswith(("audio_decoder_mtp.", "audio_decoder_mtp_shared."))]
    assert tower_keys and any(not torch.equal(tower_before[k], tower_after[k]) for k in tower_keys)  # trained now
    # ... and untouched by the backbone-only steps: still the seeded initialisation
    torch.manual_seed(0)
    initial = Drama3ForSpeechGeneration(Drama3Config.from_pretrained(out / "checkpoint-2")).state_dict()
    assert all(torch.equal(initial[k], tower_before[k]) for k in tower_keys)
    assert not torch.equal(initial["lm_head.weight"], tower_before["lm_head.weight"])
    report = json.loads((out / "preparation.json").read_text())
    assert report["kept"] == 16 and not report["skipped"]  # train split only: 2 voices x 8
    logged = [row for row in first if "loss" in row]
    assert [row["step"] for row in logged] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in logged)
    assert (out / "losses.png").is_file()

    model = AutoModel.from_pretrained(out / "model").eval()
    processor = AutoProcessor.from_pretrained(out / "model")
    assert isinstance(processor.codec, Drama3MelCodecModel) and processor.num_codebooks == 2
    assert model.config.num_codebooks == 2 and model.config.audio_decoder_config.vocab_size == 16
    assert model.config.sampling_rate == 22050 and model.config.frame_rate == pytest.approx(22050 / 1024)
    assert (model.config.semantic_loss_weight, model.config.codebook_loss_weight) == (1.0, 0.25)
    assert model.generation_config.scene_mode == "turns"  # trained on single-speaker rows: scenes turn by turn
    assert model.generation_config.temperature == TINY_TEMPERATURE
    assert model.generation_config.repetition_aware is TINY_REPETITION_AWARE is False
    # the corpus's speaking rate in this tokenizer's tokens, where frame budgets read it
    from recipes.drama3_tiny.lm_recipe import speaking_rate
    from recipes.drama3_tiny.corpus import read_manifest

    train = [r for r in read_manifest(corpus / "manifest.jsonl") if r.split == "train"]
    measured = speaking_rate(processor, [r.directed_text for r in train], [r.duration for r in train])
    assert model.generation_config.text_tokens_per_second == measured
    # no training leftovers: Trainer's use_cache=False, sub-configs without a dtype
    saved = json.loads((out / "model" / "config.json").read_text())
    assert "use_cache" not in saved
    assert saved["text_config"]["dtype"] == saved["audio_decoder_config"]["dtype"] == "float32"
    # the tokenizer carries the semantic band the config points at
    semantic = processor.tokenizer.convert_tokens_to_ids("<|semantic:0|>")
    assert model.config.semantic_start_token_id == semantic
    assert model.config.semantic_end_token_id == semantic + 15
    inputs = processor("A short test.", reference_audio=[str(corpus / "wavs" / "A-train-00000.wav")],
                       reference_text=["reference words"], sampling_rate=None)
    codes = model.generate(**inputs, seed=0, max_new_tokens=6)
    assert codes.shape[0] == 1 and codes.shape[-1] == 2 and codes.shape[1] <= 6


def test_export_bundles_the_model_and_one_plain_clip_per_voice(corpus, codec_dir, tmp_path):
    from recipes.drama3_tiny.lm_training import assemble_model_folder, load_codec
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from recipes.drama3_tiny.export import export
    from transformers_drama3 import Drama3ForSpeechGeneration
    from recipes.drama3_tiny.corpus import read_manifest

    codec = load_codec(codec_dir)
    tokenizer = build_tiny_tokenizer(["some corpus words here"] * 4, 16)
    model = Drama3ForSpeechGeneration(tiny_model_config(tokenizer, 2, 16))
    assemble_model_folder(model, tokenizer, codec, tmp_path / "model")
    export(tmp_path / "model", corpus, tmp_path / "package", voice_names=("A", "B"))
    voices = tmp_path / "package" / "voices"
    assert sorted(p.name for p in voices.glob("*.wav")) == ["A.wav", "B.wav"]
    records = {r.transcript: r for r in read_manifest(corpus / "manifest.jsonl")}
    for voice in ("A", "B"):
        record = records[(voices / f"{voice}.txt").read_text().strip()]
        assert record.voice == voice and record.split == "train" and not record.directions
    assert (tmp_path / "package" / "codec" / "config.json").is_file()
    reloaded = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "package")
    torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight)
    # a model folder without a recorded speaking rate gets the corpus's, measured at export
    assert getattr(Drama3ForSpeechGeneration.from_pretrained(tmp_path / "model").generation_config,
                   "text_tokens_per_second", None) is None
    rate = reloaded.generation_config.text_tokens_per_second
    assert isinstance(rate, float) and 1.0 < rate < 30.0
    # the processor warns about references shorter than drama3-tiny clones from
    from recipes.drama3_tiny.export import SHORT_REFERENCE_SECONDS
    from transformers_drama3 import Drama3Processor

    assert Drama3Processor.from_pretrained(tmp_path / "package").short_reference_seconds == SHORT_REFERENCE_SECONDS


def test_a_run_on_some_voices_reads_only_their_utterances(corpus, tmp_path):
    """`lm_training --voices` (and `text_use --voices`) take the named voices' utterances only, and
    `export --voices` measures the speaking rate on those voices and bundles only them."""
    from recipes.drama3_tiny.corpus import read_manifest
    from recipes.drama3_tiny.lm_training import corpus_records, main

    every = corpus_records(corpus)
    only_b = corpus_records(corpus, voices=["B"])
    assert {r["speaker"] for r in every} == {"A", "B"} and only_b
    assert only_b == [r for r in every if r["speaker"] == "B"]
    assert {r["speaker"] for r in corpus_records(corpus, "heldout", ["A"])} == {"A"}
    assert len(read_manifest(corpus / "manifest.jsonl")) > len(every)  # the held-out split is left out
    with pytest.raises(SystemExit, match="no train utterances of voices Z"):
        main(["--corpus", str(corpus), "--codec", "unused", "--out", str(tmp_path / "run"), "--voices", "Z"])


def test_export_can_bundle_another_codec_of_the_same_codes_and_refuses_one_of_other_codes(corpus, codec_dir, tmp_path):
    import json

    from recipes.drama3_tiny.export import export
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from recipes.drama3_tiny.lm_training import assemble_model_folder, load_codec
    from transformers_drama3 import Drama3ForSpeechGeneration

    codec = load_codec(codec_dir)
    tokenizer = build_tiny_tokenizer(["some corpus words here"] * 4, 16)
    assemble_model_folder(Drama3ForSpeechGeneration(tiny_model_config(tokenizer, 2, 16)), tokenizer, codec,
                          tmp_path / "model")
    retuned = load_codec(codec_dir)
    with torch.no_grad():
        for parameter in retuned.parameters():
            parameter.add_(0.5)
    retuned.save_pretrained(tmp_path / "retuned")
    export(tmp_path / "model", corpus, tmp_path / "package", voice_names=("A",), codec=tmp_path / "retuned")
    bundled = load_codec(tmp_path / "package" / "codec")
    for name, tensor in retuned.state_dict().items():
        assert torch.equal(bundled.state_dict()[name], tensor), name

    shutil.copytree(codec_dir, tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "codebook_size": 32}))
    with pytest.raises(ValueError, match="its codebook_size differs"):
        export(tmp_path / "model", corpus, tmp_path / "package", voice_names=("A",), force=True,
               codec=tmp_path / "other")
    for name, tensor in retuned.state_dict().items():  # the folder already exported is left as it was
        assert torch.equal(load_codec(tmp_path / "package" / "codec").state_dict()[name], tensor), name


def test_export_measures_the_speaking_rate_on_the_bundled_voices(corpus, codec_dir, tmp_path):
    from recipes.drama3_tiny.export import record_speaking_rate
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from recipes.drama3_tiny.lm_training import assemble_model_folder, load_codec
    from transformers_drama3 import Drama3ForSpeechGeneration

    codec = load_codec(codec_dir)
    tokenizer = build_tiny_tokenizer(["some corpus words here"] * 4, 16)
    assemble_model_folder(Drama3ForSpeechGeneration(tiny_model_config(tokenizer, 2, 16)), tokenizer, codec,
                          tmp_path / "model")
    rates = {}
    for voices in (("A",), ("B",), None):
        folder = tmp_path / f"rate-{voices}"
        shutil.copytree(tmp_path / "model", folder)
        rates[voices] = record_speaking_rate(tmp_path / "model", corpus, folder, voices)
    # voice A speaks at 170 words a minute, B at 160: the same texts take B longer
    assert rates[("A",)] != rates[("B",)]
    assert min(rates[("A",)], rates[("B",)]) <= rates[None] <= max(rates[("A",)], rates[("B",)])


def test_the_speaking_rate_is_the_median_of_tokens_a_second(tmp_path):
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, speaking_rate
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.prompting import Script

    texts = ["one", "one two three", "one two three four five six"]
    processor = Drama3Processor(build_tiny_tokenizer(texts * 4, 16, tmp_path), codebook_size=16, num_codebooks=2)
    tokens = []
    for text in texts:
        start, stop = processor.rows(Script(lines=text)).speak_span
        tokens.append(stop - start)
    assert tokens[0] < tokens[1] < tokens[2]
    seconds = [1.0, 2.0, 4.0]
    rates = sorted(t / s for t, s in zip(tokens, seconds))
    assert speaking_rate(processor, texts, seconds) == round(rates[1], 1)
    with pytest.raises(ValueError, match="positive duration"):
        speaking_rate(processor, texts, [0.0, 0.0, 0.0])


# ---- the short-to-long curriculum ----------------------------------------------------------------


def test_the_curriculum_starts_with_the_shortest_utterances_and_ends_with_all():
    from recipes.drama3_tiny.lm_training import CURRICULUM_START, CurriculumSampler

    lengths = list(range(1000, 0, -1))  # item i has length 1000 - i
    sampler = CurriculumSampler(lengths, batch_size=4, steps=100, total_batches=300, seed=0)
    first = [lengths[i] for b in range(50) for i in sampler.batch(b)]
    last = [lengths[i] for b in range(200, 300) for i in sampler.batch(b)]
    assert sampler.allowed(0) == CURRICULUM_START * 1000 and sampler.allowed(50) == 650
    assert max(first) <= 650
    assert max(last) > 900 and min(last) < 100


def test_a_curriculum_batch_depends_only_on_the_seed_and_its_position():
    from recipes.drama3_tiny.lm_training import CurriculumSampler

    lengths = [7, 3, 9, 1, 4, 8, 2, 6, 5, 0] * 10
    one = CurriculumSampler(lengths, batch_size=2, steps=5, total_batches=12, seed=3)
    other = CurriculumSampler(lengths, batch_size=2, steps=5, total_batches=12, seed=3)
    assert list(one) == [i for b in range(12) for i in other.batch(b)]  # resuming at batch b draws the same
    assert len(one) == 24 and len(set(one.batch(0))) == 2


def test_resume_takes_the_newest_checkpoint_whose_state_was_written(tmp_path):
    from recipes.drama3_tiny.lm_training import last_complete_checkpoint

    for step in (200, 400, 600):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (200, 400):
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-400"  # 600 was cut while saving


def test_the_phoneme_tokenizer_records_its_front_end_and_spells_tags_as_text(tmp_path):
    from recipes.drama3_tiny.lm_recipe import PHONEME_LANGUAGES, build_tiny_tokenizer
    from transformers_drama3.processing_drama3 import Drama3Processor

    texts = ["(fast) Hello [pause] there.", "<whisper>Keep it down</whisper>.", "<spanish>Hola amigo.</spanish>"]
    tokenizer = build_tiny_tokenizer(texts, 16, tmp_path, text_frontend="phonemes")
    processor = Drama3Processor(tokenizer, codebook_size=16, num_codebooks=2)
    assert processor.text_frontend["language"] == "en-us" and processor.text_frontend["languages"] == PHONEME_LANGUAGES
    tokens = tokenizer.convert_ids_to_tokens(processor.rows(processor.as_request(texts[0], [], "text")).input_ids.tolist())
    assert "[pause]" in "".join(t for t in tokens if not t.startswith("<|")).replace("Ġ", " ")
    assert "<|ph:h|>" in tokens and "<|ph:oʊ|>" in tokens


def test_the_reference_pool_can_leave_short_utterances_out():
    from datasets import Dataset

    from recipes.drama3_tiny.lm_training import reference_pool

    dataset = Dataset.from_dict({"speaker": ["A", "A", "A"], "frames": [10, 50, 60]})
    assert reference_pool(dataset, 40).others("A", exclude=1) == [2]
    assert reference_pool(dataset, 40, 55).others("A", exclude=2) == [1]
    assert reference_pool(dataset).others("A", exclude=1) == [0, 2]
