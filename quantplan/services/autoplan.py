"""Automatic plans: the cheapest plan under a KL budget from the stored sweeps, saved and verified.

:class:`AutoPlan` is a command in the style of Superset's ``commands/``: built with what a person asked,
:meth:`AutoPlan.validate` refuses (:class:`~quantplan.services.errors.Refused`, nothing saved) what cannot be
answered, and :meth:`AutoPlan.run` validates, decides (quantcore.planning.autoplan), saves the plan version and
queues the score that checks its prediction, in named steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quantplan.services.errors import Refused
from quantplan.services.jobs import list_jobs
from quantplan.services.kernels import kernel_records, measured_device_for
from quantplan.services.models import attention_heads, layer_names, layer_shapes, routed_layers
from quantplan.services.plans import list_plans, save_plan
from quantplan.services.predictions import correction_for
from quantplan.services.queue import submit
from quantplan.services.scoring import kv_alone_score
from quantplan.services.sweeps import (
    planner_sweeps,
    schemes_swept_on,
    sensitivity_map,
    split_scale_schemes,
    stale_sweeps,
    verify_tokens,
)
from quantplan.services.units import mib_text
from store.records import JobRecord, ModelRecord, PlanRecord, ScoreRecord


def budget_check(result: dict[str, Any], kl_budget: float) -> Any:
    """The verifying score job's ``result`` (its measured KL ± error, sequences and positions) against the automatic
    plan's budget (quantcore.planning.autoplan.check_budget): "within the budget" only beyond the error; where the
    budget lies inside it, about how many more sequences and tokens would settle it."""
    from quantcore.planning.autoplan import check_budget

    sequences, positions = result.get("sequences"), result.get("tokens")
    seq_len = positions // sequences + 1 if sequences and positions else None  # positions are tokens - 1 each
    return check_budget(float(result["kl_mean"]), result.get("kl_mean_err"), kl_budget, sequences=sequences,
                        seq_len=seq_len)


def cost_text(value: float, unit: str) -> str:
    """An automatic plan's cost as a person reads it: weight bits in MiB, times in ms."""
    from quantcore.planning.costs import UNIT_BITS

    if unit == UNIT_BITS:
        return f"{mib_text(value)} of weights"
    return f"{value:.4g} {unit}"


STEP_TOKENS = 2048  # M of the step whose time an automatic plan minimises, unless asked otherwise (a prefill)

AUTO_COSTS = {  # what an automatic plan minimises
    "auto": "measured step time on the target where its kernel timings are stored, else weight memory",
    "bits": "weight memory (stored bits, scales included)",
    "ideal": "ideal (roofline) step time on the target at M tokens",
}


@dataclass
class AutoPlan:
    """Choose the cheapest plan under the KL budget from the stored sensitivity sweeps, save it as a plan version,
    and queue a score job that checks the prediction.

    ``cost`` (:data:`AUTO_COSTS`): the target's measured kernel times at M = ``m`` when stored, else weight bits
    (``"auto"``); weight bits; or the roofline bound at ``m`` on the target's datasheet (``"ideal"``). ``kv_cache``:
    the plan caches K and V in that format; its KL, measured alone (:func:`kv_alone_score`), comes off the budget
    before the linears are chosen and is added to their predicted KL. ``tensor_parallel``: the GPUs the plan is
    served on; a scheme is not offered to a layer whose share on one GPU vLLM would refuse
    (quantcore.models.parallel), and the plan keeps the size (and ``expert_parallel``: an MoE model's experts whole,
    one GPU each). ``queue_job(kind, params, model_id=, plan_id=)`` writes the verifying job (default
    :func:`~quantplan.services.queue.submit`; the CLI's --local writes one to run itself).
    """

    model: ModelRecord
    kl_budget: float
    target: str
    m: int = STEP_TOKENS
    candidates: list[str] | None = None
    verify: bool = True
    device: str = "cpu"
    cost: str = "auto"
    kv_cache: str = "AUTO"
    tensor_parallel: int = 1
    expert_parallel: bool = False
    queue_job: Callable[..., JobRecord] | None = None
    # the unit KLs searched on: Fisher estimates ("fisher") or exact sweeps ("kl"); None (the default): the Fisher
    # estimates where the model has any, else its exact sweeps (validate() settles it, and a note says which)
    sensitivity: str | None = None
    correct: bool = True  # search under the budget corrected by the team's verified plans (services.predictions)
    # a plan's transforms.rotation to consider (issue #46): the plan is searched on the unrotated sweeps and on those
    # made rotated so (`quantplan sensitivity --rotation`), and the cheaper under the budget is kept, the note says
    rotation: dict[str, Any] | None = None
    rotated: bool = field(default=False, init=False)  # whether the plan chosen rotates the model
    correction: Any = field(default=None, init=False)  # the quantcore.planning.correction.Correction used, or None
    # what validate() found, for the steps of run()
    _sens: dict[str, dict[str, float]] = field(default_factory=dict, init=False, repr=False)
    _unit_layers: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False)
    _kv: str = field(default="AUTO", init=False, repr=False)
    _alone: ScoreRecord | None = field(default=None, init=False, repr=False)
    _fallback: str | None = field(default=None, init=False, repr=False)  # why the default searched the exact sweeps
    _sens_rot: dict[str, dict[str, float]] = field(default_factory=dict, init=False, repr=False)
    _source: str = field(default="", init=False, repr=False)
    _unit_layers_rot: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False)

    def validate(self) -> None:
        """Refused (nothing saved or queued): a model with no sensitivity sweep, an unknown cost, a KV cache format
        whose KL alone is not measured yet or already spends the budget."""
        from quantcore.evaluation.kvcache import get_kv_format

        model = self.model
        self._fallback = None
        if self.sensitivity is None:  # the fast estimate by default, where there is one to search on
            has_fisher = bool(sensitivity_map(model, self.tensor_parallel, self.expert_parallel, "fisher")[0])
            self.sensitivity = "fisher" if has_fisher else "kl"
            if not has_fisher:
                self._fallback = (f"searched on the exact sweeps: {model.name} has no Fisher estimate yet (the default "
                                  f"when it has; `quantplan sensitivity {model.name} --scheme SCHEME --method fisher`)")
        if self.sensitivity not in ("kl", "fisher"):
            raise Refused(f"unknown sensitivity {self.sensitivity!r}; choose kl (exact sweeps) or fisher (estimates)")
        self._sens, self._unit_layers = sensitivity_map(model, self.tensor_parallel, self.expert_parallel,
                                                        self.sensitivity)
        if not self._sens:
            fast = self.sensitivity == "fisher"
            raise Refused(f"{model.name} has no {'Fisher estimate' if fast else 'sensitivity sweep'} yet: run one per "
                          f"candidate scheme first (Results page, or `quantplan sensitivity {model.name} --scheme "
                          f"FP8_DYNAMIC{' --method fisher' if fast else ''}`)")
        if self.cost not in AUTO_COSTS:
            raise Refused(f"unknown cost {self.cost!r}; choose one of: {', '.join(AUTO_COSTS)}")
        if self.rotation is not None:
            self._rotated_sweeps()
        kv = self._kv = get_kv_format(self.kv_cache).name
        self._alone = None
        if kv != "AUTO":
            alone = self._alone = kv_alone_score(model, kv)
            if alone is None:
                raise Refused(f"the KL of a {kv} KV cache on {model.name} is not known yet: score it alone first "
                              f"(`quantplan score {model.name} --scheme BF16 --kv-cache {kv}`, or preset BF16 with "
                              f"KV cache {kv} on the Results page)")
            if alone.kl_mean >= self.kl_budget:
                raise Refused(f"a {kv} KV cache alone costs KL {alone.kl_mean:.4g} on {model.name} (score job "
                              f"#{alone.job_id}), no less than the budget {self.kl_budget:g}: raise the budget or "
                              "keep the KV cache in AUTO")

    def _rotated_sweeps(self) -> None:
        """The sweeps made in the model rotated by :attr:`rotation` (its form checked, normalised); Refused where
        there is none of this method."""
        from quantcore.algorithms.rotation_spec import rotation_from_dict
        from quantcore.errors import PlanError

        try:
            spec = rotation_from_dict(self.rotation, "the rotation to consider")
        except PlanError as exc:
            raise Refused(str(exc)) from exc
        self.rotation = spec.to_dict()
        self._sens_rot, self._unit_layers_rot = sensitivity_map(self.model, self.tensor_parallel,
                                                                self.expert_parallel, self.sensitivity or "kl",
                                                                self.rotation)
        if not self._sens_rot:
            flags = f"--rotation {spec.kind}" + (f" --rotation-block {spec.block_size}" if spec.block_size else "")
            raise Refused(f"{self.model.name} has no {'Fisher estimate' if self.sensitivity == 'fisher' else 'sweep'} "
                          f"made rotated ({spec.label()}) to weigh the rotation with: run one per candidate scheme "
                          f"first (`quantplan sensitivity {self.model.name} --scheme MXFP4 {flags}"
                          f"{' --method fisher' if self.sensitivity == 'fisher' else ''}`)")

    def run(self) -> tuple[Any, PlanRecord, JobRecord | None]:
        """(quantcore.planning.autoplan.AutoPlanResult, the plan version saved or found, the verifying score job
        or None): :meth:`validate`, then choose, explain, save and verify. Refused where no candidate can be used."""
        self.validate()
        assert self.sensitivity is not None  # validate() settled the default
        result, table = self._choose()
        if self.rotation is not None:
            result = self._with_rotation(result, table)
        read = planner_sweeps(self.model, self.tensor_parallel, self.expert_parallel, self.sensitivity,
                              self.rotation if self.rotated else None)
        self._explain(result, table, read)
        plan, job = self._save(result)
        if self.verify and job is None:
            job = self._queue_verification(result, plan, read)
        return result, plan, job

    # ------------------------------------------------------------------------- the steps

    @property
    def _candidates(self) -> list[str]:
        return self.candidates or sorted(set(self._sens) | {"BF16"})

    @property
    def _kv_kl(self) -> float:
        return self._alone.kl_mean if self._alone is not None else 0.0

    def _parallel(self):
        from quantcore.models.parallel import Parallelism

        tp = self.tensor_parallel
        return Parallelism(tp, attention_heads(self.model) if tp > 1 else None, self.expert_parallel)

    def _cost_table(self) -> tuple[dict[str, dict[str, float]] | None, str]:
        """({scheme: {layer: cost}} or None for weight bits, the cost's source) of one GPU's share of each layer."""
        from quantcore.kernels.roofline import cost_from_roofline
        from quantcore.planning.costs import COST_IDEAL, COST_MEASURED, cost_from_kernel_records
        from quantcore.schemes.fusion import expert_block

        model, cands, parallel = self.model, self._candidates, self._parallel()
        per_gpu = parallel.shards(layer_shapes(model))  # what one GPU runs: the time costs are of these shapes
        table, source = None, COST_MEASURED
        device_name = measured_device_for(self.target) if self.cost == "auto" else None
        if device_name:
            table = cost_from_kernel_records(kernel_records(device_name), per_gpu, cands, m=self.m,
                                             target=self.target, routed=routed_layers(model))
            if not table.get("BF16"):
                table = None
        if self.cost == "ideal":
            table = cost_from_roofline(sorted(set(cands) | {"BF16"}), per_gpu, self.target, self.m,
                                       routed_layers(model))
            source = COST_IDEAL
        if table is not None and parallel.split and parallel.expert_parallel:
            # each GPU holds 1 / tp of the experts (quantcore.models.parallel.Parallelism.first_gpu): an expert's
            # time counts on one GPU's step in that share
            table = {s: {layer: ms / self.tensor_parallel if expert_block(layer) is not None else ms
                         for layer, ms in times.items()} for s, times in table.items()}
        return table, source

    def _choose(self):
        """(the solver's result, the cost table it minimised); Refused where every candidate but BF16 is excluded."""
        from quantcore.planning.autoplan import auto_plan as solve

        model, cands = self.model, self._candidates
        table, source = self._cost_table()
        self._source = source  # the rotated search (_with_rotation) costs the same way
        budget = self.kl_budget - self._kv_kl
        self.correction = correction_for(model, self.sensitivity) if self.correct else None
        if self.correction is not None:  # the sum of units to search under, so that the corrected KL fits
            budget = self.correction.search_budget(budget)
        result = solve(layer_names(model), self._sens, kl_budget=budget, target=self.target,
                       candidates=cands, cost=table, layer_shapes=layer_shapes(model), unit_layers=self._unit_layers,
                       cost_source=source, tied=model.tied_linears, parallel=self._parallel())
        if not [c for c in cands if c != "BF16" and c not in result.excluded]:  # a plan of BF16 alone answers nothing
            raise Refused(f"no candidate scheme can be used on {model.name} for {self.target}: " + "; ".join(
                why for c, why in result.excluded.items() if c != "BF16"))
        return result, table

    def _with_rotation(self, plain, table):
        """The cheaper of ``plain`` (searched on the unrotated sweeps) and the plan searched on the rotated ones, both
        under the budget; a note says which and what the other cost. Rotated, the candidates are those swept rotated
        (and BF16)."""
        from quantcore.planning.autoplan import auto_plan as solve

        model = self.model
        budget = self.kl_budget - self._kv_kl
        if self.correction is not None:
            budget = self.correction.search_budget(budget)
        cands = [c for c in self._candidates if c in self._sens_rot or c == "BF16"]
        rotated = solve(layer_names(model), self._sens_rot, kl_budget=budget, target=self.target, candidates=cands,
                        cost=table, layer_shapes=layer_shapes(model), unit_layers=self._unit_layers_rot,
                        cost_source=self._source, tied=model.tied_linears,
                        parallel=self._parallel()) if cands else None
        label = self._rotation_label()
        usable = rotated is not None and rotated.predicted_kl <= budget and rotated.plan
        if usable and rotated.cost < plain.cost:
            self.rotated = True
            rotated.notes.append(f"rotation {label} chosen: {cost_text(rotated.cost, rotated.cost_unit)}, predicted KL "
                                 f"{rotated.predicted_kl:.4g}, against {cost_text(plain.cost, plain.cost_unit)} "
                                 f"(KL {plain.predicted_kl:.4g}) without it (searched on the sweeps made rotated)")
            return rotated
        plain.notes.append(f"rotation {label} not chosen: " + (
            f"{cost_text(rotated.cost, rotated.cost_unit)} (KL {rotated.predicted_kl:.4g}) with it, no cheaper than "
            f"{cost_text(plain.cost, plain.cost_unit)} without" if usable and rotated is not None
            else "no plan under the budget from the sweeps made rotated"))
        return plain

    def _rotation_label(self) -> str:
        from quantcore.algorithms.rotation_spec import rotation_from_dict

        return rotation_from_dict(self.rotation).label() if self.rotation is not None else "none"

    def _explain(self, result, table, read: list[JobRecord]) -> None:
        """The notes a person reads beside the plan: candidates left out, the KV cache's share of the budget, stale
        sweeps, one-GPU sweeps standing in for several GPUs, and what the cost is."""
        model, cost, m, target, tp = self.model, self.cost, self.m, self.target, self.tensor_parallel
        parallel = self._parallel()
        result.notes += [f"{c} not used: {why}" for c, why in result.excluded.items() if c != "BF16"]
        source = "Fisher estimates" if self.sensitivity == "fisher" else "exact sweeps"
        if self._fallback:
            result.notes.append(self._fallback)
        if self.correction is not None:
            result.kl_budget = self.kl_budget
            result.notes.append(f"predicted from {source}, corrected by the verified automatic plans of "
                                f"{model.architecture} models: {self.correction.text()}; the units' KLs were searched "
                                f"to sum to at most {self.correction.search_budget(self.kl_budget - self._kv_kl):.4g} "
                                f"(corrected prediction {self.corrected_kl(result):.4g})")
        else:
            result.notes.append(f"predicted from {source}; no verified automatic plan of a {model.architecture} model "
                                f"from {source} yet to correct the prediction by")
        if self._alone is not None:
            kv_kl = self._kv_kl
            result.predicted_kl += kv_kl
            result.kl_budget = self.kl_budget
            result.notes.append(f"KV cache {self._kv}: KL {kv_kl:.4g} measured alone (score job "
                                f"#{self._alone.job_id}); the linear layers were chosen under the rest of the budget "
                                f"({self.kl_budget - kv_kl:.4g}) and the prediction adds the two (the KLs of "
                                "independent small errors roughly add)")
        stale = stale_sweeps(model)
        result.notes += [stale[j.id][1] for j in read if j.id in stale and stale[j.id][0] in self._candidates]
        if parallel.split:
            at_tp = schemes_swept_on(read, tp, self.expert_parallel)
            split = split_scale_schemes({scheme for n, scheme in result.plan.items()
                                         if parallel.input_shards(n) > 1 and scheme not in at_tp})
            if split:
                gpus = f"--tp {tp}" + (" --expert-parallel" if parallel.expert_parallel else "")
                result.notes.append(f"predicted from one-GPU sensitivity sweeps of {', '.join(split)}: on {tp} "
                                    "GPUs each quantizes its share of o_proj's and down_proj's input on its own "
                                    "dynamic scale, which those sweeps do not see, so the plan's KL there is likely "
                                    f"lower than predicted (the verifying score runs on {tp} GPUs). Sweep them on "
                                    f"{tp} GPUs for a closer prediction (`quantplan sensitivity {model.name} "
                                    f"--scheme {split[0]} {gpus}`, or the Results page's GPU count)")
        if cost == "ideal":
            result.notes.append(f"cost: the ideal (roofline) step time at M={m} on {target}, from its datasheet"
                                + (f", of one GPU's share of every layer over {tp}" if parallel.split else ""))
        elif table is None:
            result.notes.append(f"no kernel timings of a {target} are stored"
                                + (f" for one GPU's share of every layer over {tp} (bench --tp {tp})"
                                   if parallel.split else "")
                                + ": cost is the stored weight bits, scales included"
                                if cost == "auto" else "cost: the stored weight bits, scales included")

    def corrected_kl(self, result) -> float | None:
        """The plan's predicted KL under the correction (None without one); the KV cache's KL, measured, stays."""
        if self.correction is None:
            return None
        return self.correction.corrected(result.predicted_kl - self._kv_kl) + self._kv_kl

    def plan_name(self) -> str:
        """One plan name per question asked, the cost minimised part of it: ``auto-h100-kl0.05-ideal-m1``."""
        return (f"auto-{self.target}-kl{self.kl_budget:g}"
                + {"auto": "", "bits": "-bits", "ideal": f"-ideal-m{self.m}"}[self.cost]
                + ("" if self._kv == "AUTO" else f"-kv-{self._kv.lower()}")
                + (f"-tp{self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                + ("-ep" if self.expert_parallel else "")
                + ("-fisher" if self.sensitivity == "fisher" else "")
                + ("-rot" if self.rotation is not None else ""))

    def _save(self, result) -> tuple[PlanRecord, JobRecord | None]:
        """(the plan version, a score job already checking it): a new version, or, asked again with nothing new,
        the newest one of that name and its queued, running or finished score."""
        from quantcore.planning.plans import spec_from_plan

        model, name = self.model, self.plan_name()
        spec = spec_from_plan(result.plan, model=model.name, name=name)
        spec.kv_cache = self._kv
        spec.tensor_parallel = self.tensor_parallel
        spec.expert_parallel = self.expert_parallel
        if self.rotated:  # the plan scores, exports and serves rotated (transforms.rotation)
            from quantcore.algorithms.rotation_spec import rotation_from_dict

            spec.rotation = rotation_from_dict(self.rotation)
        body = spec.to_dict()
        versions = [p for p in list_plans(model.id) if p.name == name]
        if versions and versions[-1].body == body:  # asked again with nothing new: the same plan, no new version
            plan = versions[-1]
            result.notes.append(f"the same plan as {plan.label}: no new version saved")
            job = next((j for j in list_jobs(limit=500, kind="score")
                        if j.plan_id == plan.id and j.status in ("queued", "running", "succeeded")), None)
            return plan, job
        plan = save_plan(model.id, name, body,
                         note=f"auto: predicted KL {result.predicted_kl:.4g} ≤ {self.kl_budget:g} on {self.target}")
        return plan, None

    def _queue_verification(self, result, plan: PlanRecord, read: list[JobRecord]) -> JobRecord:
        """The score job that checks the prediction, on the tokens of the sweeps it was predicted from."""
        tokens, note = verify_tokens(read, set(result.plan.values()))
        if note:
            result.notes.append(note)
        which = {"sensitivity": self.sensitivity} if self.sensitivity != "kl" else {}
        return (self.queue_job or submit)("score", {"predicted_kl": result.predicted_kl, "label": plan.label,
                                                    "device": self.device, **tokens, **which},
                                          model_id=self.model.id, plan_id=plan.id)
