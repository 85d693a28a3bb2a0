"""Presets shipped with jetrl (installed as ``jetrl_cli.presets``): one YAML file per recipe."""
