"""TfdsSource on a tiny array_record dataset built locally: no TensorFlow, no network."""

import sys

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")
pytest.importorskip("array_record")

from sat_jax.data import PromptIterator, TfdsSource  # noqa: E402


class SatJaxTinyMath(tfds.core.GeneratorBasedBuilder):
    """Five GSM8K-style train records, two test records."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = {"question": tfds.features.Text(), "answer": tfds.features.Text()}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(5), "test": self._generate_examples(2)}

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tf_loaded_before = "tensorflow" in sys.modules
    root = tmp_path_factory.mktemp("tfds")
    SatJaxTinyMath(data_dir=str(root), file_format="array_record").download_and_prepare()
    if not tf_loaded_before:
        assert "tensorflow" not in sys.modules, "building the dataset imported TensorFlow"
    return root


def test_reads_by_name_without_tensorflow(data_dir):
    tf_loaded_before = "tensorflow" in sys.modules
    src = TfdsSource("sat_jax_tiny_math", split="train", data_dir=data_dir)
    assert len(src) == 5 and src.name == "sat_jax_tiny_math/train"
    examples = list(src)
    # TFDS stores records in a shuffled order; compare as sets.
    assert {ex["prompt"] for ex in examples} == {f"What is {i}+1?" for i in range(5)}
    for ex in examples:
        assert isinstance(ex["prompt"], str) and isinstance(ex["answer"], str)
        n = int(ex["prompt"].split()[2].split("+")[0])
        assert src.reward(rf"\boxed{{{n + 1}}}", ex) == 1.0
        assert src.reward(str(n + 2), ex) == 0.0
    if not tf_loaded_before:
        assert "tensorflow" not in sys.modules


def test_from_builder_with_answer_fn_and_iterator(data_dir):
    builder = SatJaxTinyMath(data_dir=str(data_dir))
    src = TfdsSource(builder, split="test", answer_fn=lambda a: a.split("####")[-1].strip())
    assert sorted(ex["answer"] for ex in src) == ["1", "2"]
    it = PromptIterator(src, batch_size=2, seed=0)
    assert sorted(ex["index"] for ex in next(it)) == [0, 1]


def test_missing_field_is_named(data_dir):
    src = TfdsSource("sat_jax_tiny_math", split="train", data_dir=data_dir, prompt_field="q")
    with pytest.raises(ValueError, match="missing field 'q'"):
        src[0]


class SatJaxMixedFeatures(tfds.core.GeneratorBasedBuilder):
    """Records whose other features are not text: a flag, a vector and raw (non-UTF-8) bytes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = {
            "question": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "flag": tfds.features.Tensor(shape=(), dtype=np.bool_),
            "vector": tfds.features.Tensor(shape=(2,), dtype=np.int64),
            "blob": tfds.features.Text(),
        }
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(3)}

    def _generate_examples(self, n):
        for i in range(n):
            yield (
                i,
                {
                    "question": f"{i}+1=",
                    "answer": str(i + 1),
                    "flag": i % 2 == 0,
                    "vector": np.array([i, -i], np.int64),
                    "blob": b"\xff\xfe" + bytes([i]),
                },
            )


def test_only_prompt_and_answer_are_decoded(tmp_path):
    SatJaxMixedFeatures(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    src = TfdsSource("sat_jax_mixed_features", split="train", data_dir=tmp_path)
    examples = sorted(src, key=lambda ex: ex["prompt"])
    assert [(ex["prompt"], ex["answer"]) for ex in examples] == [
        ("0+1=", "1"),
        ("1+1=", "2"),
        ("2+1=", "3"),
    ]
    first = examples[0]
    assert bool(first["flag"]) is True
    np.testing.assert_array_equal(first["vector"], [0, 0])
    assert first["blob"] == b"\xff\xfe\x00"  # left as TFDS returns it


def test_non_utf8_prompt_is_named(tmp_path):
    SatJaxMixedFeatures(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    src = TfdsSource(
        "sat_jax_mixed_features", split="train", data_dir=tmp_path, prompt_field="blob"
    )
    with pytest.raises(ValueError, match=r"record 0: field 'blob' is not valid UTF-8"):
        src[0]
