"""`quantobs.quark` and `quantobs.torch_ao` are the faces' modules."""

import quantobs.faces.quark
import quantobs.faces.torch_ao
import quantobs.quark
import quantobs.torch_ao


def test_short_names_are_the_face_modules() -> None:
    assert quantobs.quark is quantobs.faces.quark
    assert quantobs.torch_ao is quantobs.faces.torch_ao
    from quantobs.quark import PerTensorMinMaxObserver
    from quantobs.torch_ao import MinMaxObserver

    assert PerTensorMinMaxObserver is quantobs.faces.quark.PerTensorMinMaxObserver
    assert MinMaxObserver is quantobs.faces.torch_ao.MinMaxObserver
