"""`astraflow keys`: the controller's CURVE key store and members' own key pairs."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Authentication keys (ZeroMQ CURVE): key store, member keys.", no_args_is_help=True)

KeysOpt = Annotated[
    Path,
    typer.Option("--keys", help="Key store directory (the controller's --keys; default <run-dir>/keys)."),
]


@app.command("init")
def init(keys: KeysOpt) -> None:
    """Create a key store: the controller's key pair and an empty member registry."""
    from astraflow.transport.keys import KeyStore

    store = KeyStore.init(keys)
    pair = store.controller_keypair()
    typer.echo(f"created key store {keys}")
    typer.echo(f"controller public key: {pair.public.decode()}")
    typer.echo(f"members pass: --controller-key {keys / 'controller.key'}  (or the key above)")


@app.command("new")
def new(
    name: Annotated[str, typer.Argument(help="Member name (its member id), e.g. raas-gpu1.")],
    out_dir: Annotated[
        Path, typer.Option("--dir", help="Directory to write NAME.key and NAME.key_secret.")
    ] = Path("."),
) -> None:
    """Make a member's own key pair; send only NAME.key (public) to the controller's operator."""
    from astraflow.transport.keys import load_keypair, new_key_files

    public, secret = new_key_files(out_dir, name)
    typer.echo(f"wrote {secret} (secret: keep it on this machine) and {public}")
    typer.echo(f"public key: {load_keypair(secret).public.decode()}")
    typer.echo(
        f"on the controller host: astraflow keys add {name} {public} --keys DIR --role raas|trainer|observer|operator"
    )


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Member name; the member must use it as its member id.")],
    public_key: Annotated[
        str, typer.Argument(help="The member's NAME.key file, or its 40-character Z85 key.")
    ],
    keys: KeysOpt,
    role: Annotated[
        str,
        typer.Option(
            "--role", help="raas, trainer, observer (reads status) or operator (also pauses, drains, stops)."
        ),
    ],
    policy: Annotated[
        str | None, typer.Option("--policy", help="The one policy this key may act for (trainers: required).")
    ] = None,
) -> None:
    """Register a member key; a running controller accepts it from its next poll on."""
    from astraflow.errors import AstraflowError
    from astraflow.transport.keys import KeyStore, load_public

    if role == "trainer" and not policy:
        raise AstraflowError("a trainer key needs --policy", hint="a trainer trains exactly one policy")
    made_as = _key_file_name(public_key)
    if made_as and made_as != name:
        raise AstraflowError(
            f"{public_key} is the key of {made_as!r} (astraflow keys new {made_as}), not of {name!r}: "
            f"its holder connects as {made_as!r}, so the controller would refuse it under {name!r}",
            hint=f"add it under its own name: astraflow keys add {made_as} {public_key} --keys {keys} "
            f"--role {role}{' --policy ' + policy if policy else ''}; or make a key named {name}: "
            f"astraflow keys new {name}",
        )
    store = KeyStore(keys)
    store.add(name, load_public(public_key), role, policy)
    typer.echo(f"added {name} ({role}{', policy ' + policy if policy else ''})")


def _key_file_name(spec: str) -> str:
    """The name a NAME.key file was made with (the member id its holder uses), or "" when unknown."""
    from pathlib import Path

    path = Path(spec)
    if not path.is_file():
        return ""  # a Z85 key given as text carries no name
    for line in path.read_text(errors="replace").splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.strip() == "name":
            return value.strip().strip("\"'")
    # `keys new NAME` writes NAME.key; its NAME.key_secret carries the name the member connects as
    secret = path.with_name(path.name + "_secret")
    if secret.is_file():
        from astraflow.transport.keys import load_keypair

        return load_keypair(secret).name
    return path.name.removesuffix(".key") if path.name.endswith(".key") else ""


@app.command("revoke")
def revoke(
    name: Annotated[str, typer.Argument(help="Member name to revoke.")],
    keys: KeysOpt,
) -> None:
    """Revoke a member key; a running controller refuses its frames within a fraction of a second."""
    from astraflow.transport.keys import KeyStore

    KeyStore(keys).revoke(name)
    typer.echo(f"revoked {name}")


@app.command("list")
def list_(keys: KeysOpt) -> None:
    """List member keys: name, role, policy, state, public key."""
    from astraflow.transport.keys import KeyStore

    store = KeyStore(keys)
    typer.echo(f"controller {store.controller_keypair().public.decode()}")
    for name, row in sorted(store.members().items()):
        state = "revoked" if row.get("revoked") else "active"
        added = datetime.datetime.fromtimestamp(row.get("added", 0), datetime.UTC).strftime("%Y-%m-%d %H:%M")
        typer.echo(
            f"{name:24} {row['role']:8} {row.get('policy') or '-':12} {state:8} {added} {row['public_key']}"
        )
