"""The notebook workbench: the ipyparallel cluster and `jax.distributed`, the generation widget,
and decode profiles.
"""
