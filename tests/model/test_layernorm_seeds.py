"""The seeds' worked LayerNorm numbers, reproduced by nn.LayerNorm, AddNorm and ONNX LayerNormalization."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from addnorm.model.encoder import AddNorm

SEED_DECIMALS = 4  # the seeds print four decimals
SEED_INPUT = [[[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]]  # seeds 000 and 001: [B=1, S=2, E=3]
SEED_OUTPUT = [[0.0, -1.2238, 1.2238], [1.4140, -0.7070, -0.7070]]
SEED_MEAN, SEED_STD = [0.2000, 0.2333], [0.0817, 0.1886]
SEED002_INPUT = [[0.2, 0.8, 1.0, 1.2], [1.0, 0.0, 0.5, 1.5]]
SEED002_OUTPUT = [[-1.6036, 0.0, 0.5345, 1.0690], [0.4472, -1.3416, -0.4472, 1.3416]]


def seed_000_layer_norm(inputs: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, ...]:
    """Seed 000/001's notebook code: reshape [B,S,E] -> [S,B,E], normalize over the last two dims (1, 3)."""
    b, s, e = inputs.size()
    x = inputs.reshape(s, b, e)
    dims = [-1, -2]
    mean = x.mean(dim=dims, keepdim=True)
    std = (((x - mean) ** 2).mean(dim=dims, keepdim=True) + eps).sqrt()
    return (x - mean) / std, mean, std


def seed_002_layer_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Seed 002's numpy variant: population std, and eps added to the std instead of the variance."""
    return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + eps)


def onnx_layer_norm(x: np.ndarray, axis: int = -1, eps: float = 1e-5) -> np.ndarray:
    """One ONNX LayerNormalization node (gamma 1, beta 0) run by onnxruntime."""
    norm_shape = x.shape[axis:]
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=axis, epsilon=eps)
    graph = helper.make_graph(
        [node],
        "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
        initializer=[
            helper.make_tensor("g", TensorProto.FLOAT, norm_shape, np.ones(norm_shape).ravel()),
            helper.make_tensor("b", TensorProto.FLOAT, norm_shape, np.zeros(norm_shape).ravel()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})[0]


def test_seed_000_worked_numbers():
    y, mean, std = seed_000_layer_norm(torch.tensor(SEED_INPUT))
    np.testing.assert_allclose(mean.flatten(), SEED_MEAN, atol=1e-4)
    np.testing.assert_allclose(std.flatten(), SEED_STD, atol=1e-4)
    np.testing.assert_allclose(y.reshape(2, 3), SEED_OUTPUT, atol=10**-SEED_DECIMALS)


def test_nn_layer_norm_over_last_dim_gives_the_seed_numbers():
    y = torch.nn.LayerNorm(3, eps=1e-5)(torch.tensor(SEED_INPUT)).detach()
    np.testing.assert_allclose(y[0], SEED_OUTPUT, atol=10**-SEED_DECIMALS)


def test_add_norm_over_the_seeds_two_axes_matches_the_seed():
    """The seeds normalize over (B, E) = (1, 3) of an [S, B, E] tensor: AddNorm with a 2-dim shape does too."""
    x = torch.tensor(SEED_INPUT).reshape(2, 1, 3)  # [S, B, E]
    add_norm = AddNorm((1, 3), eps=1e-5)
    y = add_norm(x, lambda h: torch.zeros_like(h)).detach()  # zero sublayer: Add & Norm reduces to LayerNorm
    np.testing.assert_allclose(y.reshape(2, 3), SEED_OUTPUT, atol=10**-SEED_DECIMALS)
    np.testing.assert_allclose(y.numpy(), seed_000_layer_norm(torch.tensor(SEED_INPUT))[0].numpy(), atol=1e-6)


@pytest.mark.parametrize("axis", [-1, -2])
def test_onnx_layer_normalization_computes_the_seed_numbers(axis):
    x = np.array(SEED_INPUT, dtype=np.float32).reshape(2, 1, 3)  # [S, B, E]; axis -2 covers (B, E) = (1, 3)
    y = onnx_layer_norm(x, axis=axis)
    np.testing.assert_allclose(y.reshape(2, 3), SEED_OUTPUT, atol=10**-SEED_DECIMALS)


def test_seed_002_worked_numbers():
    y = seed_002_layer_norm(np.array(SEED002_INPUT))
    np.testing.assert_allclose(y, SEED002_OUTPUT, atol=10**-SEED_DECIMALS)


def test_seed_002_variant_differs_from_nn_layer_norm_when_variance_is_small():
    """std + eps vs sqrt(var + eps): equal to 4 decimals on the seed's rows, far apart when var ~ eps."""
    x = np.array(SEED002_INPUT)
    standard = torch.nn.LayerNorm(4, eps=1e-6).double()(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(seed_002_layer_norm(x), standard, atol=1e-5)  # same to 4 decimals here
    assert not np.array_equal(seed_002_layer_norm(x), standard)

    tiny = np.array([[0.0, 1e-3, 0.0, 1e-3]])  # std 5e-4: var 2.5e-7 is below eps
    variant = seed_002_layer_norm(tiny)
    standard = torch.nn.LayerNorm(4, eps=1e-6)(torch.tensor(tiny, dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(np.abs(variant), 0.998, atol=1e-3)  # ~ +-1: noise blown up to unit scale
    np.testing.assert_allclose(np.abs(standard), 0.4472, atol=1e-4)  # sqrt(var + eps) damps it
    np.testing.assert_allclose(standard, onnx_layer_norm(tiny, eps=1e-6), atol=1e-5)  # what ONNX computes
