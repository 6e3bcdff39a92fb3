"""What calibrate says about a batch layout the model cannot take, and its progress bar's total."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import dal
from dal.calibration.batches import progress_total


class TwoInputs(nn.Module):
    """forward(img, vec): an image branch and a vector branch."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc, self.head = nn.Conv2d(1, 4, 3), nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, img, vec):
        return self.head(self.conv(img).mean((2, 3)) + self.fc(vec))


def prepared():
    img, vec = torch.randn(2, 1, 8, 8), torch.randn(2, 5)
    return dal.prepare_qat(TwoInputs(), "int8_balanced", hardware="a2000", example_inputs=(img, vec)), img, vec


def test_a_pair_of_inputs_as_the_batch_names_input_fn_and_the_tuple_convention():
    model, img, vec = prepared()
    with pytest.raises(ValueError) as info:
        dal.calibrate(model, [(img, vec)], progress=False)
    msg = str(info.value)
    assert "calibration batch 0" in msg and "TypeError" in msg and "called with 1 positional input(s)" in msg
    assert "((img, vec), target)" in msg and "input_fn=lambda batch: (args, kwargs)" in msg


def test_a_dict_batch_with_other_keys_names_input_fn():
    model, img, vec = prepared()
    with pytest.raises(ValueError) as info:
        dal.calibrate(model, [{"image": img, "vector": vec, "label": torch.zeros(2)}], progress=False)
    msg = str(info.value)
    assert "keyword inputs ['image', 'label', 'vector']" in msg and "input_fn=" in msg and "model(**batch)" in msg


def test_the_conventions_the_message_gives_calibrate():
    model, img, vec = prepared()
    dal.calibrate(model, [((img, vec), torch.zeros(2))], progress=False)
    model, img, vec = prepared()
    dal.calibrate(model, [{"image": img, "vector": vec}], input_fn=lambda b: ((b["image"], b["vector"]), {}),
                  progress=False)


def test_a_batch_the_model_fails_on_for_another_reason_gets_no_layout_hint():
    model, img, vec = prepared()
    with pytest.raises(ValueError) as info:
        dal.calibrate(model, [((img, torch.randn(2, 6)), 0)], progress=False)  # vec of the wrong width
    assert "input_fn" not in str(info.value)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randn(4, 2, 1, 28, 28))


def test_progress_total_is_what_will_run():
    loader = DataLoader(TensorDataset(torch.randn(32, 1, 28, 28)), batch_size=8)  # 4 batches
    assert progress_total(loader, 32) == 4
    assert progress_total(loader, 2) == 2
    assert progress_total(loader) == 4
    assert progress_total(DataLoader(Stream(), batch_size=None), 32) is None
    assert progress_total((x for x in range(3)), 32) is None


def test_the_calibrate_bar_counts_the_batches_there_are(capsys):
    from dal_examples.zoo import MnistCNN

    x = torch.randn(8, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(), "int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [x] * 4, num_batches=32, progress=True)
    err = capsys.readouterr().err
    assert "/4 " in err and "/32" not in err
