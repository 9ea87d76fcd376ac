"""TfdsSource on a tiny array_record dataset built locally: no TensorFlow, no network."""

import sys

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
