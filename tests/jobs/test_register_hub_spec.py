"""RegisterSpec's hub id: ``hub`` (ORG/NAME) and ``revision`` travel in a job's parameters, alone, never with a
source or the demo, and a revision never without a hub id."""

from __future__ import annotations

import pytest

from jobs.errors import InvalidJob
from jobs.specs import RegisterSpec


def test_a_hub_registration_keeps_its_id_and_revision_and_nothing_else():
    spec = RegisterSpec.from_params({"hub": "test-org/tiny-llama", "revision": "v1", "user": "ann"})
    assert (spec.hub, spec.revision, spec.source, spec.demo) == ("test-org/tiny-llama", "v1", None, False)
    params = spec.to_params()
    assert params["hub"] == "test-org/tiny-llama" and params["revision"] == "v1"
    assert not any("token" in key for key in params)
    assert RegisterSpec.from_params(params) == spec


@pytest.mark.parametrize(("params", "says"), [
    ({"hub": "org/name", "source": "/x"}, "one of source, hub and demo"),
    ({"hub": "org/name", "demo": True}, "one of source, hub and demo"),
    ({"revision": "main", "source": "/x"}, "revision belongs to a hub id"),
    ({"hub": 3}, "must be text"),
    ({}, "a source"),
])
def test_a_hub_id_with_another_source_or_a_revision_alone_is_refused(params, says):
    with pytest.raises(InvalidJob, match=says):
        RegisterSpec.from_params(params)
