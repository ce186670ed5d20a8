"""The YAML configs tfmem ships (installed as `tfmem.configs`); copy one to start your own."""
