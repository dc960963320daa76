"""Problems: per-sample losses on a flat parameter vector, with batched gradients over a cohort.

:data:`PROBLEMS` registers each by name; a factory takes the source's samples (for the input width,
image shape, vocabulary and number of classes) and the problem's own settings, its typed keyword parameters (the
``[problem]`` section).
Any ``torch.nn.Module`` becomes a problem through :class:`ModuleProblem`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, PositiveInt

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Example, ModelSize, Registry
from fedshuffle.data.catalog import Samples
from fedshuffle.problems.base import Problem
from fedshuffle.problems.convex import LogisticRegression, Quadratic, SoftmaxRegression
from fedshuffle.problems.models import CNN, CharLSTM, ResNet18, glorot_weights, lenet5, mnist_cnn, pfl_cnn
from fedshuffle.problems.modules import ModuleProblem, batchnorm_to_groupnorm, cross_entropy
from fedshuffle.problems.networks import MLP, Network


#: L2 regularization λ: (λ/2)‖x‖² in every sample's loss
L2 = Annotated[float, Field(ge=0, description="L2 regularization λ: (λ/2)‖x‖² in every sample's loss")]


def _width(samples: Samples) -> int:
    return int(samples.features.reshape(len(samples.features), -1).shape[1])


def _classes(samples: Samples, problem: str) -> int:
    if samples.num_classes < 1:
        raise ConfigError(
            "name",
            f"{problem!r} is a classifier, but the data source has no class labels (source 'targets' suits "
            "'quadratic')",
        )
    return max(samples.num_classes, 2)


def _image(samples: Samples, problem: str) -> tuple[int, int, int]:
    """(channels, height, width) of the samples: as given, (H, W) as one channel, or a flat square as one channel."""
    shape = tuple(samples.features.shape[1:])
    if len(shape) == 2:
        shape = (1, *shape)
    elif len(shape) == 1 and math.isqrt(shape[0]) ** 2 == shape[0]:
        shape = (1, math.isqrt(shape[0]), math.isqrt(shape[0]))
    if len(shape) != 3:
        raise ConfigError(
            "name",
            f"{problem!r} needs images (channels, height, width); the data source gives samples of shape "
            f"{tuple(samples.features.shape[1:])}",
        )
    return shape


def quadratic(samples: Samples) -> Quadratic:
    return Quadratic(_width(samples))


def logistic(samples: Samples, l2: L2 = 0.0) -> LogisticRegression:
    if _classes(samples, "logistic") > 2:
        raise ConfigError(
            "name", f"logistic regression needs binary labels, data has {samples.num_classes} classes; use 'softmax'"
        )
    return LogisticRegression(_width(samples), l2)


def softmax(samples: Samples, l2: L2 = 0.0) -> SoftmaxRegression:
    return SoftmaxRegression(_width(samples), _classes(samples, "softmax"), l2)


def mlp(
    samples: Samples,
    hidden: Annotated[list[PositiveInt], Field(min_length=1, description="hidden layer widths"), ModelSize()] = (32,),
    l2: L2 = 0.0,
) -> MLP:
    return MLP(_width(samples), hidden, _classes(samples, "mlp"), l2)


def two_nn(samples: Samples, l2: L2 = 0.0) -> MLP:
    return MLP(_width(samples), (200, 200), _classes(samples, "2nn"), l2)


def cnn(
    samples: Samples,
    l2: L2 = 0.0,
    dropout: Annotated[
        bool,
        Field(
            description="pfl-research's dropout layers (0.25 after pooling, 0.5 after the dense layer), seeded per "
            "client and step"
        ),
    ] = True,
) -> CNN:
    return CNN(_image(samples, "cnn"), _classes(samples, "cnn"), l2, dropout)


def _images_problem(module_fn, name: str, samples: Samples, l2: float) -> ModuleProblem:
    shape = _image(samples, name)
    return ModuleProblem(module_fn(shape, _classes(samples, name)), sample_shape=shape, l2=l2, name=name)


def mnist_cnn_problem(samples: Samples, l2: L2 = 0.0) -> ModuleProblem:
    return _images_problem(mnist_cnn, "mnist_cnn", samples, l2)


def lenet5_problem(samples: Samples, l2: L2 = 0.0) -> ModuleProblem:
    return _images_problem(lenet5, "lenet5", samples, l2)


def resnet18(
    samples: Samples,
    l2: L2 = 0.0,
    norm_groups: Annotated[PositiveInt, Field(description="groups of every GroupNorm layer")] = 2,
    resnet_stem: Annotated[
        Literal["cifar", "imagenet"],
        Field(description="3×3 first convolution without pooling (cifar) or 7×7 stride 2 and max-pool (imagenet)"),
    ] = "cifar",
    resnet_width: Annotated[
        PositiveInt, Field(description="channels of the first stage (64; the stages have 1, 2, 4, 8 times as many)")
    ] = 64,
) -> ModuleProblem:
    shape = _image(samples, "resnet18")
    module = ResNet18(shape[0], _classes(samples, "resnet18"), norm_groups, resnet_stem, resnet_width)
    return ModuleProblem(module, sample_shape=shape, l2=l2, name="resnet18")


def char_lstm(
    samples: Samples,
    l2: L2 = 0.0,
    embedding: Annotated[PositiveInt, Field(description="embedding dimension")] = 8,
    lstm_hidden: Annotated[PositiveInt, Field(description="hidden state size of each LSTM layer")] = 512,
    lstm_layers: Annotated[PositiveInt, Field(description="stacked LSTM layers")] = 2,
) -> ModuleProblem:
    """Token ids ``(N, length)`` (integers, or floats holding them); the vocabulary is the larger of the
    number of classes and the largest token id + 1."""
    tokens = np.asarray(samples.features)
    integral = tokens.dtype.kind in "iu" or (
        tokens.dtype.kind == "f" and bool(np.all((tokens >= 0) & (tokens == np.floor(tokens))))
    )
    if not integral or tokens.ndim != 2:
        raise ConfigError(
            "name",
            f"'char_lstm' needs sequences of integer token ids (N, length); the data source gives {tokens.dtype} "
            f"samples of shape {tokens.shape[1:]}",
        )
    vocabulary = max(samples.num_classes, int(tokens.max(initial=0)) + 1)
    return ModuleProblem(
        CharLSTM(vocabulary, embedding, lstm_hidden, lstm_layers),
        sample_shape=tokens.shape[1:],
        l2=l2,
        name="char_lstm",
    )


#: Problems by name; a factory takes the source's samples and the problem's settings. ``classes``: the number of classes
#: a problem takes where it takes only one (the checks of :mod:`fedshuffle.testing` run it on such data).
PROBLEMS = Registry("problem.name", runtime=("samples",), noun="problem")
PROBLEMS.add(
    "quadratic",
    quadratic,
    "f_ij(x) = ½‖x − a_ij‖², the samples as targets",
    "Horváth et al., TMLR 2022 (FedShuffle), eq. (36)",
    example=Example(sections={"data": {"source": "targets", "client_sizes": [1, 2, 3]}}),
)
PROBLEMS.add(
    "logistic",
    logistic,
    "L2-regularized binary logistic regression, labels ±1",
    "Mishchenko et al., RR-CLI; Malinovsky et al., Nastya",
    classes=2,
    example=Example(),
)
PROBLEMS.add(
    "softmax", softmax, "multinomial logistic regression (+ L2)", "Yang, Fang & Liu, ICLR 2021", example=Example()
)
PROBLEMS.add(
    "mlp", mlp, "fully connected ReLU network, cross-entropy", "FedCDR (784-128-26 on FEMNIST)", example=Example()
)
PROBLEMS.add(
    "2nn",
    two_nn,
    "two hidden layers of 200, ReLU (the 2NN)",
    "Yang, Fang & Liu, ICLR 2021; McMahan et al., AISTATS 2017",
    example=Example(),
)
PROBLEMS.add(
    "mnist_cnn",
    mnist_cnn_problem,
    "conv 5×5×32, pool, conv 5×5×64, pool, dense 512 (Table 4)",
    "Yang, Fang & Liu, ICLR 2021, Table 4",
    example=Example(
        sections={"data": {"source": "npz", "partition": "iid", "clients": 3}},
        arrays={"x": ((12, 1, 28, 28), None), "y": ((12,), 3)},
    ),
)
PROBLEMS.add(
    "lenet5",
    lenet5_problem,
    "LeNet-5: conv 5×5 (6), pool, conv 5×5 (16), pool, dense 120, 84",
    "Malinovsky, Mishchenko & Richtárik, Fig. 2 (CIFAR-10)",
    example=Example(
        sections={"data": {"source": "npz", "partition": "iid", "clients": 3}},
        arrays={"x": ((12, 3, 32, 32), None), "y": ((12,), 3)},
    ),
)
PROBLEMS.add(
    "cnn",
    cnn,
    "two-convolution CNN of pfl-research's CIFAR-10 benchmark, with its dropout",
    "Granqvist et al., pfl-research, arXiv:2404.06430",
    example=Example(
        sections={"data": {"source": "npz", "partition": "iid", "clients": 3}},
        arrays={"x": ((12, 3, 8, 8), None), "y": ((12,), 3)},
    ),
)
PROBLEMS.add(
    "char_lstm",
    char_lstm,
    "next-character LSTM: embedding 8, 2×512 LSTM, dense over the vocabulary",
    "Horváth et al., TMLR 2022 (FedShuffle), Shakespeare",
    example=Example(
        settings={"lstm_hidden": 8, "lstm_layers": 1},
        sections={"data": {"source": "npz", "partition": "iid", "clients": 3}},
        arrays={"x": ((12, 6), 5), "y": ((12,), 5)},
    ),
)
PROBLEMS.add(
    "resnet18",
    resnet18,
    "ResNet-18 with GroupNorm (2 groups)",
    "Horváth et al., TMLR 2022 (FedShuffle), CIFAR-100; Hsieh et al., ICML 2020",
    example=Example(
        sections={"data": {"source": "npz", "partition": "iid", "clients": 3}},
        arrays={"x": ((12, 3, 32, 32), None), "y": ((12,), 3)},
        settings={"resnet_width": 4},
    ),
)

__all__ = [
    "CNN",
    "CharLSTM",
    "LogisticRegression",
    "MLP",
    "ModuleProblem",
    "Network",
    "PROBLEMS",
    "Problem",
    "Quadratic",
    "ResNet18",
    "SoftmaxRegression",
    "batchnorm_to_groupnorm",
    "cross_entropy",
    "glorot_weights",
    "lenet5",
    "mnist_cnn",
    "pfl_cnn",
]
