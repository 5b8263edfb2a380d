"""An account's own templates through the SDK's templates calls: a running
sandbox named as a template (POST /v1/templates, which the SDK has no call
for) is listed and read by `templates.list`/`get`, creates sandboxes with
its files, is another account's 404, and `templates.delete` removes it
(a first-party one stays)."""

import pytest

from pandastack import NotFoundError, PandastackError


def test_a_sandbox_named_as_a_template_serves_the_sdks_template_calls(shoal, make_account):
    owner = make_account("team", "templates")
    client = shoal.client(owner.token)
    source = client.sandboxes.create(template="base")
    made = []
    try:
        source.filesystem.write("/opt/model/weights.txt", "trained")
        r = shoal.http(owner.token).post(
            f"{shoal.url}/v1/templates",
            json={"name": "trained", "from_sandbox": source.id},
            timeout=300,
        )
        assert r.status_code == 201, r.text

        listed = {t.name: t for t in client.templates.list()}
        assert {"base", "code-interpreter", "trained"} <= set(listed)
        assert listed["trained"].is_global is False and listed["base"].is_global is True
        got = client.templates.get("trained")
        assert (got.name, got.base, got.workspace) == ("trained", "base", owner.name)
        assert got.cpu == listed["base"].cpu and got.memory_mb == listed["base"].memory_mb

        child = client.sandboxes.create(template="trained")
        made.append(child)
        assert child.exec("cat /opt/model/weights.txt").stdout == "trained"

        stranger = shoal.client(make_account("team", "templates-stranger").token)
        with pytest.raises(NotFoundError):
            stranger.templates.get("trained")
        with pytest.raises(PandastackError):
            made.append(stranger.sandboxes.create(template="trained"))

        with pytest.raises(PandastackError):
            client.templates.delete("base")
        client.templates.delete("trained")
        with pytest.raises(NotFoundError):
            client.templates.get("trained")
        assert "trained" not in {t.name for t in client.templates.list()}
        # What was made from it runs on.
        assert child.exec("cat /opt/model/weights.txt").stdout == "trained"
    finally:
        for sandbox in made + [source]:
            try:
                sandbox.kill()
            except PandastackError:
                pass
