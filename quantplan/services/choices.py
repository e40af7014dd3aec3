"""The plan version "chosen" for a model: a team's decision (who, when, why), one per model at a time.

Members and admins choose (access "choose_plan"); everyone reads. Each choice, and each clearing of one, is a line of
the audit log (``choose-plan`` / ``unchoose-plan``): the history of a model's choices, with what each replaced. The
Plans page, the History and the exports read :func:`chosen_for` / :func:`chosen_plans`.
"""

from __future__ import annotations

from collections.abc import Iterable

from quantplan.services import access
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from store import chosen, repo
from store.chosen import ChosenRecord
from store.db import session_scope
from store.records import PlanRecord
from store.removal import refuse_removed

MAX_WHY = 2_000


def choose_plan(plan_ref: int | str, why: str) -> ChosenRecord:
    """Make plan version ``plan_ref`` (an id, ``name@vN``) the one chosen for its model, by the person acting,
    with ``why`` (required: the reason is the decision's point); replaces the model's earlier choice. Refused for a
    viewer, an empty or over-long reason, and a removed model; audited with the choice it replaced."""
    actor = access.require("choose_plan")
    why = why.strip()
    if not why:
        raise Refused("say why this version is chosen (--why): the reason is what the team reads later")
    if len(why) > MAX_WHY:
        raise Refused(f"the reason is {len(why):,} characters; at most {MAX_WHY:,}")
    with session_scope(settings()) as s:
        plan = repo.get_plan(s, plan_ref)
        model = repo.get_model(s, plan.model_id)
        if (refusal := refuse_removed(model, "a plan choice")) is not None:
            raise Refused(refusal)
        before, after = chosen.choose(s, plan_id=plan.id, by=actor.name, why=why)
        access.audit("choose-plan", f"model #{model.id} {model.name}",
                     {"plan_id": plan.id, "plan": plan.label, "why": why,
                      "replaced": before.label if before is not None and before.plan_id != plan.id else None},
                     session=s)
        return after


def unchoose(model_ref: int | str) -> ChosenRecord | None:
    """Clear the model's chosen plan version (members and admins; audited); the choice cleared, None if none."""
    access.require("choose_plan")
    with session_scope(settings()) as s:
        model = repo.get_model(s, model_ref)
        before = chosen.unchoose(s, model.id)
        if before is not None:
            access.audit("unchoose-plan", f"model #{model.id} {model.name}",
                         {"plan_id": before.plan_id, "plan": before.label, "why": before.why}, session=s)
        return before


def chosen_for(model_id: int) -> ChosenRecord | None:
    """The plan version chosen for the model, or None."""
    with session_scope(settings()) as s:
        return chosen.chosen_for_model(s, model_id)


def chosen_plans(model_ids: Iterable[int] | None = None) -> dict[int, ChosenRecord]:
    """{model id: its chosen plan version} of every model (None) or of these."""
    with session_scope(settings()) as s:
        return chosen.chosen_plans(s, model_ids)


def choice_history(model_id: int) -> list[dict[str, object]]:
    """The model's choices and clearings, newest first, from the audit log: {at, by, action, plan, why, replaced}.
    Everyone may read them (the audit log itself is an admin's)."""
    from store import team

    with session_scope(settings()) as s:
        model = repo.get_model(s, model_id)
        target = f"model #{model.id} {model.name}"
        rows = [a for action in ("choose-plan", "unchoose-plan") for a in team.list_audit(s, action=action)
                if a.target == target]
    rows.sort(key=lambda a: (a.at, a.id), reverse=True)
    return [{"at": a.at, "by": a.actor, "action": a.action, "plan": a.detail.get("plan"),
             "why": a.detail.get("why"), "replaced": a.detail.get("replaced")} for a in rows]


def chosen_comment(plan: PlanRecord, comment: str = "#") -> str:
    """The line an exported file of ``plan`` starts with when it is the version chosen for its model ("# chosen
    for MODEL by NAME on DATE UTC: WHY"); "" otherwise. A comment, so the recipe or script reads the same."""
    with session_scope(settings()) as s:
        choice = chosen.chosen_for_model(s, plan.model_id)
        if choice is None or choice.plan_id != plan.id:
            return ""
        model = repo.get_model(s, plan.model_id)
    why = " ".join(choice.why.split())
    return (f"{comment} quantplan: {choice.label} is the version chosen for {model.name}, by {choice.chosen_by} "
            f"on {choice.chosen_at:%Y-%m-%d %H:%M} UTC: {why}\n")
