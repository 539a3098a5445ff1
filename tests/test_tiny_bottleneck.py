"""Where drama3-tiny loses its words (`recipes.drama3_tiny.bottleneck`)."""

import pytest
import torch

from recipes.drama3_tiny.bottleneck import VARIANTS, level_energy, teacher_forced, variants
from tiny_recipe_helpers import held_out_setup


def tiny_codec(num_codebooks=3, codebook_size=8):
    from transformers_drama3.codec.mel_codec import Drama3MelCodecConfig, Drama3MelCodecModel

    torch.manual_seed(0)
    codec = Drama3MelCodecModel(Drama3MelCodecConfig(num_codebooks=num_codebooks, codebook_size=codebook_size)).eval()
    codec.codebooks.copy_(torch.randn_like(codec.codebooks))
    codec.feature_mean.copy_(torch.randn_like(codec.feature_mean))
    codec.feature_scale.copy_(torch.rand_like(codec.feature_scale) + 0.5)
    return codec


def test_the_first_levels_alone_dequantise_to_their_own_centroids():
    codec = tiny_codec()
    codes = torch.randint(0, 8, (2, 3, 5))
    torch.testing.assert_close(codec.dequantize(codes, levels=3), codec.dequantize(codes))
    first = codec.codebooks[0][codes[:, 0]] * codec.feature_scale + codec.feature_mean  # [2, 5, 4 * 80]
    expected = first.reshape(2, 5 * codec.config.mel_frames_per_frame, codec.config.n_mels).transpose(1, 2)
    torch.testing.assert_close(codec.dequantize(codes, levels=1), expected)
    for levels in (0, 4):
        with pytest.raises(ValueError, match="levels must be 1..3"):
            codec.dequantize(codes, levels=levels)


def test_level_energy_sums_each_codebooks_chosen_centroids():
    codec = tiny_codec()
    codes = torch.randint(0, 8, (1, 3, 6))
    energy = level_energy(codec, codes)
    assert energy.shape == (3,)
    torch.testing.assert_close(energy[2], sum(codec.codebooks[2][c].square().sum() for c in codes[0, 2]))


def tiny_model_and_rows(num_codebooks=3, codebook_size=16):
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.prompting import Reference, Script

    texts = ["the cat sat on the mat", "a dog ran to the park"]
    tokenizer = build_tiny_tokenizer(texts, codebook_size)
    torch.manual_seed(1)
    model = Drama3ForSpeechGeneration(tiny_model_config(tokenizer, num_codebooks, codebook_size, hidden_size=64)).eval()
    processor = Drama3Processor(tokenizer, codebook_size=codebook_size, num_codebooks=num_codebooks)
    generator = torch.Generator().manual_seed(2)
    reference = Reference(transcript=texts[1], audio=torch.randint(0, codebook_size, (num_codebooks, 40), generator=generator))
    script = Script(lines=texts[0], references=[reference],
                    target=torch.randint(0, codebook_size, (num_codebooks, 7), generator=generator))
    return model, processor, processor.rows(script)


def test_teacher_forcing_scores_each_level_as_the_training_losses_do():
    model, processor, rows = tiny_model_and_rows()
    forced = teacher_forced(model, processor, rows)
    true = forced["true"]
    assert true.shape == (7, 3) and forced["backbone"].shape == (7,) and forced["tower"].shape == (7, 2)
    # the target frames are the script's target, in order
    targets = processor.token_ids.is_semantic(rows.input_ids) & rows.supervised
    assert torch.equal(true, rows.audio_codes[targets])
    # per-level sums over the frames give the forward's own semantic and codebook losses
    batch = processor.pad([rows], return_labels=True, padding_side="right")
    with torch.no_grad():
        output = model(**batch)
    frames = len(true)
    torch.testing.assert_close(forced["cross_entropy"][0] / frames, output.semantic_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(forced["cross_entropy"][1:].sum() / (2 * frames), output.codebook_loss, rtol=1e-5, atol=1e-6)
    # argmax counts agree with the argmaxes returned
    assert int(forced["correct"][0]) == int((forced["backbone"] == true[:, 0]).sum())
    assert torch.equal(forced["correct"][1:], (forced["tower"] == true[:, 1:]).sum(0))
    # codebook 0 is argmax over the semantic band only
    assert int(forced["backbone"].max()) < processor.token_ids.codebook_size


def test_each_variant_replaces_only_its_own_levels():
    model, processor, rows = tiny_model_and_rows()
    forced = teacher_forced(model, processor, rows)
    made = variants(forced)
    assert tuple(made) == VARIANTS
    true = forced["true"]
    assert torch.equal(made["true codes"], true)
    assert torch.equal(made["backbone codebook 0"][:, 1:], true[:, 1:])
    assert torch.equal(made["backbone codebook 0"][:, 0], forced["backbone"])
    assert torch.equal(made["tower codebooks 1+"][:, 0], true[:, 0])
    assert torch.equal(made["tower codebooks 1+"][:, 1:], forced["tower"])
    assert torch.equal(made["both predicted"], torch.cat([forced["backbone"][:, None], forced["tower"]], 1))


def test_rows_without_a_target_frame_are_refused():
    from transformers_drama3.prompting import Script

    model, processor, _ = tiny_model_and_rows()
    rows = processor.rows(Script(lines="the cat sat on the mat"))
    with pytest.raises(ValueError, match="no target frame"):
        teacher_forced(model, processor, rows)


@pytest.mark.slow
def test_the_true_codes_decode_to_the_same_audio_as_all_their_levels(tmp_path):
    import numpy as np

    from recipes.drama3_tiny.bottleneck import measure, tables

    dataset, model, processor, codec = held_out_setup(tmp_path, heldout_sentences=2)
    processor.codec = codec
    sounds = []

    def keep(audio, rate):  # a stand-in reader: "hears" the index of the audio it was given
        sounds.append(np.asarray(audio, dtype=np.float32))
        return str(len(sounds) - 1)

    result = measure(model, processor, dataset, utterances=3, transcribe=keep, progress=False)
    assert result["utterances"] == 3 and [row["codebook"] for row in result["levels"]] == [0, 1]
    heard = result["heard"]

    def audio(name):
        return [sounds[int(index)] for index in heard[name]]

    # decoding the true codes is Griffin-Lim over all their levels: the same audio (two paths)
    for decoded, summed in zip(audio("true codes"), audio("first 2")):
        assert decoded.shape == summed.shape
        np.testing.assert_allclose(decoded, summed, rtol=1e-4, atol=1e-5)
    # one level alone is another sound
    assert any(not np.allclose(one, both, atol=1e-3) for one, both in zip(audio("first 1"), audio("first 2")))
    assert sum(row["energy_share"] for row in result["levels"]) == pytest.approx(1.0)
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in result["levels"])
    assert "| tower codebooks 1+ |" in tables(result)
