"""The recipes ``tpu-train recipe=NAME`` runs: each ``NAME.py`` here is a script with ``main(cfg)``.

Copy one to start your own (``tpu-train recipe=./my_recipe.py``); the copy composes the config
named by its ``RECIPE_CONFIG``.
"""
