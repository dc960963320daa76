"""An experiment file as validated: its metadata (``[experiment]``), its base sections, its variants
(``[[variants]]``) and claims, and the runs they give (base ← variant ← overrides, each a :class:`RunSpec`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedshuffle import plugins
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.validation import validate
from fedshuffle.experiments.schema.base import _Section
from fedshuffle.experiments.schema.names import name_problem
from fedshuffle.experiments.schema.overrides import _blamed_on_override, _merge_parts
from fedshuffle.experiments.schema.sections import SECTIONS, RunSpec, _PartialSections
from fedshuffle.experiments.schema.tuning import TuneConfig


class ExperimentMeta(_Section):
    name: str = Field(
        "experiment",
        description="also the results folder's name (results/<name>): no '/', '\\', control characters, '.' or '..'",
    )
    title: str = ""
    paper: str = ""
    figure: str = ""
    description: str = ""
    seeds: list[int] | None = None
    budget: Literal["cpu", "gpu"] | None = Field(
        None,
        description="hardware the preset is sized for: 'cpu' (a 2-core CPU) or 'gpu' (the paper's scale, needs a GPU)",
    )
    expected_minutes: float | None = Field(
        None,
        gt=0,
        description="expected wall time of the whole preset (every variant and seed) on its budget's hardware",
    )
    deviations: list[str] = Field(
        default_factory=list,
        description="where the experiment departs from the paper (a setting the paper does not give, a substitute "
        "dataset, a reduced scale); printed beside its verdicts",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description=(
            "modules to import first: they register the parts this experiment names; each is code, imported only "
            "with the consent of whoever runs the config (--plugins or FEDSHUFFLE_PLUGINS, fedshuffle.plugins)"
        ),
    )
    not_reproducible: str = Field(
        "",
        description=(
            "why the paper's experiment cannot be run with the data at hand (e.g. its dataset cannot be built); when "
            "given, every claim reads "
            "'not reproducible', with what the substitute measured, never 'holds' or 'does not hold'"
        ),
    )

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not v:
            raise ValueError(
                "an empty list runs no seed of its own (run.seed would run instead); accepted: a list of "
                "one or more seeds, e.g. [0, 1, 2], or no seeds (run.seed runs)"
            )
        return v

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        problem = name_problem(v)
        if problem:
            raise ValueError(f"{problem}: the name is the results folder's (results/<name>)")
        return v


class Variant(_PartialSections):
    label: str
    tune: TuneConfig | None = Field(
        None, description="the paper's tuning protocol for this variant: grid, metric, at, tuning seeds"
    )


class Experiment(_PartialSections):
    """A validated experiment: metadata, base sections, and variants."""

    experiment: ExperimentMeta = Field(default_factory=ExperimentMeta)
    variants: list[Variant] = Field(default_factory=list)
    claims: list[dict[str, Any]] = Field(
        default_factory=list, description="the paper's claims about this experiment (fedshuffle.experiments.claims)"
    )

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, raw: Any) -> Any:
        """The plugins' parts are registered before the sections naming them are validated (each plugin consented
        to, :mod:`fedshuffle.plugins`)."""
        plugins.load_entry_points()
        meta = raw.get("experiment") if isinstance(raw, Mapping) else None
        names = meta.get("plugins") if isinstance(meta, Mapping) else None
        if names is not None:
            if not isinstance(names, list):
                raise ConfigError("experiment.plugins", f"expected a list of module names, got {names!r}")
            plugins.load(names)
        return raw

    def check_tuning(self) -> None:
        """Every tuning grid point gives a valid run of its variant, and tuning seeds are never judged seeds
        (a point chosen on the seeds it is judged on would be judged on its luck)."""
        for k, variant in enumerate(self.variants):
            if variant.tune is None:
                continue
            alone = self.model_copy(update={"variants": [variant]})
            for point in variant.tune.points():
                try:
                    alone.runs(point)
                except ConfigError as exc:
                    raise ConfigError(
                        f"variants[{k}].tune.grid", f"the point {point} gives no valid run ({exc.field}: {exc.message})"
                    ) from None
            judged = set(self.experiment.seeds or [alone.runs()[0][1].run.seed])
            shared = sorted(judged & set(variant.tune.seeds))
            if shared:
                raise ConfigError(
                    f"variants[{k}].tune.seeds",
                    f"seed {shared[0]} is also a judged seed (experiment.seeds); tuning seeds must differ from the "
                    "judged ones",
                )

    def runs(self, overrides: Mapping[str, Any] | None = None, given_as: str = "--set") -> list[tuple[str, RunSpec]]:
        """(label, spec) for each variant (one unlabeled run when there are none), validated.

        Sections merge base ← variant ← ``overrides``. A variant or override that chooses another part
        than the one it replaces (another method, sampler, source, ...) starts from that part's defaults:
        the replaced part's own settings are not carried over. An override of a setting that a variant
        sets to another value is refused (it would turn every variant into the same run under its old
        label); give the variants' values in the file, or run one variant. A bad overridden setting is
        reported against the override (``given_as``: ``--set local.lrr``), not against the first variant."""
        base = {s: getattr(self, s) for s in SECTIONS}
        variants = self.variants or [Variant(label="")]
        self._check_overrides(overrides or {})
        out = []
        for k, variant in enumerate(variants):
            merged = _merge_parts(base, {s: getattr(variant, s) for s in SECTIONS})
            merged = _merge_parts(merged, overrides or {})
            prefix = f"variants[{k}] ({variant.label})." if self.variants else ""
            try:
                out.append((variant.label, validate(RunSpec, merged, prefix)))
            except ConfigError as exc:
                raise _blamed_on_override(exc, prefix, overrides or {}, given_as) from None
        return out

    def _check_overrides(self, overrides: Mapping[str, Any]) -> None:
        for section, settings in overrides.items():
            if not isinstance(settings, Mapping):
                continue
            for key, value in settings.items():
                differing = [
                    v.label
                    for v in self.variants
                    if key in (getattr(v, section, None) or {}) and getattr(v, section)[key] != value
                ]
                if len(differing) > 0 and len(self.variants) > 1:
                    raise ConfigError(
                        f"{section}.{key}",
                        "the variants set it themselves "
                        f"({', '.join(repr(d) for d in differing[:4])}{' ...' if len(differing) > 4 else ''}); "
                        "an override would give every variant the same value under its own label: edit the variants, "
                        "or run one (--variant LABEL)",
                    )

    def seeds(self, spec: RunSpec) -> list[int]:
        return self.experiment.seeds or [spec.run.seed]
