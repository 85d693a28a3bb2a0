"""Files shipped with jetrl: ``tiny-policy/`` (see ``jetrl_cli.models.make_tiny_policy``)."""
