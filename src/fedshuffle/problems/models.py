"""The source papers' neural networks, as plain ``torch.nn.Module`` s run by
:class:`~fedshuffle.problems.modules.ModuleProblem`.

* :func:`pfl_cnn` — the two-convolution CNN of pfl-research's CIFAR-10 benchmarks (Granqvist et al., arXiv:2404.06430);
* :func:`mnist_cnn` — the MNIST CNN of Yang, Fang & Liu (ICLR 2021), Table 4;
* :func:`lenet5` — LeNet-5 as in PyTorch's CIFAR-10 tutorial, Malinovsky, Mishchenko & Richtárik's Figure 2;
* :class:`CharLSTM` — the next-character LSTM of FedShuffle's Shakespeare experiments (Horváth et al., TMLR 2022, §6);
* :class:`ResNet18` — ResNet-18 (He et al., CVPR 2016) with GroupNorm (Hsieh et al., ICML 2020), FedShuffle's CIFAR-100
  model.

The 2NN of Yang et al. (two hidden layers of 200, ReLU) is :class:`~fedshuffle.problems.networks.MLP`
with ``hidden = [200, 200]``, and their multinomial logistic regression is
:class:`~fedshuffle.problems.convex.SoftmaxRegression`; both have closed-form batched gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..core.errors import ConfigError
from .modules import ModuleProblem


def _pooled(size: int, *stages: int) -> int:
    """Spatial size after valid convolutions of kernel k followed by 2×2 max-pooling, for each k in ``stages`` (0:
    pool only)."""
    for k in stages:
        size = (size - k + 1 if k else size) // 2
    return size


def _check_image(image_shape: Sequence[int], smallest: int, model: str) -> tuple[int, int, int]:
    if len(image_shape) != 3:
        raise ConfigError(
            "image_shape", f"{model!r} needs images (channels, height, width), got a sample shape {tuple(image_shape)}"
        )
    channels, height, width = (int(s) for s in image_shape)
    if min(height, width) < smallest:
        raise ConfigError(
            "image_shape", f"{model!r} needs images of at least {smallest}×{smallest} pixels, got {height}×{width}"
        )
    return channels, height, width


def glorot_weights(module: nn.Module) -> None:
    """Glorot-uniform weights of every convolution and dense layer (Keras' default, as pfl-research's models);
    biases as PyTorch's."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)


def pfl_cnn(image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, dropout: bool = True) -> nn.Sequential:
    """pfl-research's ``simple_cnn``: conv 3×3 (32) → ReLU → conv 3×3 (64) → ReLU → max-pool 2 → dropout 0.25
    → dense 128 → ReLU → dropout 0.5 → dense (classes); without the dropout layers when ``dropout`` is false."""
    channels, height, width = _check_image(image_shape, 6, "cnn")
    flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
    drop = (lambda p: [nn.Dropout(p)]) if dropout else (lambda p: [])
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        *drop(0.25),
        nn.Flatten(),
        nn.Linear(flat, 128),
        nn.ReLU(),
        *drop(0.5),
        nn.Linear(128, num_classes),
    )


def mnist_cnn(image_shape: Sequence[int] = (1, 28, 28), num_classes: int = 10) -> nn.Sequential:
    """Yang, Fang & Liu (ICLR 2021), Table 4: conv 5×5×32 + ReLU → max-pool 2×2 → conv 5×5×64 + ReLU → max-pool 2×2
    → dense 1024×512 + ReLU → dense 512×10 (valid convolutions: 28 → 24 → 12 → 8 → 4, and 64·4·4 = 1024; 582,026
    parameters, the 2.22 MiB per model of their Table 2)."""
    channels, height, width = _check_image(image_shape, 16, "mnist_cnn")
    flat = 64 * _pooled(height, 5, 5) * _pooled(width, 5, 5)
    return nn.Sequential(
        nn.Conv2d(channels, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


def lenet5(image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10) -> nn.Sequential:
    """LeNet-5 of PyTorch's CIFAR-10 tutorial (the "standard LeNet, a 5-layer CNN implemented in PyTorch" of
    Malinovsky, Mishchenko & Richtárik, Figure 2): conv 5×5 (6) → ReLU → max-pool 2 → conv 5×5 (16) → ReLU
    → max-pool 2 → dense 120 → ReLU → dense 84 → ReLU → dense (classes)."""
    channels, height, width = _check_image(image_shape, 16, "lenet5")
    flat = 16 * _pooled(height, 5, 5) * _pooled(width, 5, 5)
    return nn.Sequential(
        nn.Conv2d(channels, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


class CharLSTM(nn.Module):
    """Next-character model: embedding → stacked LSTM → dense over the vocabulary, at every position.

    FedShuffle's Shakespeare model (Horváth et al., TMLR 2022, §6: an 8-dimensional embedding, two
    LSTM layers with 512-dimensional hidden state). Inputs are token ids ``(B, L)`` (any integer or
    float dtype holding integers); outputs are scores ``(B, L, vocabulary)``.
    """

    def __init__(self, vocabulary: int, embedding: int = 8, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        for field, value in (("embedding", embedding), ("lstm_hidden", hidden), ("lstm_layers", layers)):
            if value < 1:
                raise ConfigError(field, f"must be a positive integer, got {value}")
        self.embed = nn.Embedding(vocabulary, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens.long()))
        return self.out(h)


class _Block(nn.Module):
    """Basic residual block: two 3×3 convolutions with GroupNorm, and a 1×1 projection when the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.GroupNorm(groups, outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al., CVPR 2016) with every BatchNorm replaced by GroupNorm of ``groups`` groups
    (Hsieh et al., ICML 2020; 2 groups as in TFF's ResNet-18 of Reddi et al., ICLR 2021) — FedShuffle's
    CIFAR-100 model (Horváth et al., TMLR 2022, Table 3).

    ``stem = "cifar"``: a 3×3 stride-1 first convolution without max-pooling, the usual layout for
    32×32 images; ``"imagenet"``: the original 7×7 stride-2 convolution and 3×3 max-pool. ``width``
    is the first stage's channels (64; the stages have width, 2, 4 and 8 × width): a narrower
    network of the same topology for reduced runs.
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 100, groups: int = 2, stem: str = "cifar", width: int = 64
    ) -> None:
        super().__init__()
        if width < 1:
            raise ConfigError("resnet_width", f"must be a positive integer, got {width}")
        if groups < 1 or width % groups:
            raise ConfigError("norm_groups", f"must divide the first stage's {width} channels, got {groups}")
        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.GroupNorm(groups, width), nn.ReLU()
            )
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
                nn.GroupNorm(groups, width),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            raise ConfigError("resnet_stem", f"accepted: 'cifar' or 'imagenet'; got {stem!r}")
        blocks, channels = [], width
        for stage in range(4):
            for k in range(2):
                blocks.append(_Block(channels, width << stage, 2 if stage and not k else 1, groups))
                channels = width << stage
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


class CNN(ModuleProblem):
    """pfl-research's CIFAR CNN (:func:`pfl_cnn`) as a problem: Glorot-uniform weights, cross-entropy, optional
    (λ/2)‖x‖²."""

    def __init__(
        self, image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, l2: float = 0.0, dropout: bool = True
    ) -> None:
        super().__init__(
            pfl_cnn(image_shape, num_classes, dropout),
            sample_shape=image_shape,
            l2=l2,
            initializer=glorot_weights,
            name="cnn",
        )
        self.image_shape, self.num_classes = tuple(image_shape), num_classes
