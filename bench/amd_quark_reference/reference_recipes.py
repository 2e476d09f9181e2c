"""The reference model and our configs of the six reference recipes (torch only: importable from the project venv and
from the amd-quark one). ``make_reference.py`` holds amd-quark's side of the same recipes; the compatibility tests
(``tests/quark/test_amd_quark_compat.py``) and ``bench/ptq_vs_amd_quark.py`` use these."""

from __future__ import annotations

import torch
from torch import nn

W8 = {
    "dtype": "int8",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "observer_cls": "PerChannelMinMaxObserver",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
A8 = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", "is_dynamic": False}
#: our ``Config.from_dict`` of each recipe, by the name of its reference file (``reference_<name>.pt``)
CONFIGS = {
    "w8a8": {"global_quant_config": {"weight": W8, "input_tensors": A8}},
    "w8a8_uint8_asym": {
        "global_quant_config": {"weight": W8, "input_tensors": {**A8, "dtype": "uint8", "symmetric": False}}
    },
    "w4_per_group": {
        "global_quant_config": {"weight": W8},
        "layer_type_quant_config": {
            "Linear": {
                "weight": {
                    **W8,
                    "dtype": "int4",
                    "qscheme": "per_group",
                    "ch_axis": 1,
                    "group_size": 8,
                    "observer_cls": "PerGroupMinMaxObserver",
                }
            }
        },
    },
    "fp8_e4m3": {"global_quant_config": {"weight": FP8, "input_tensors": FP8}},
    "a8_percentile": {
        "global_quant_config": {"weight": W8, "input_tensors": {**A8, "observer_cls": "PerTensorPercentileObserver"}}
    },
    "a8_mse": {"global_quant_config": {"weight": W8, "input_tensors": {**A8, "observer_cls": "PerTensorMSEObserver"}}},
}


class SmallCNN(nn.Module):
    """The reference model (make_reference.py): conv 1->8, conv 8->16 (3x3, padding 1), linear 1024->32, 32->10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] of images [batch, 1, 8, 8]."""
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
