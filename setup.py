"""Which packages the distribution holds (the rest of the metadata is in pyproject.toml).

configs/ and recipes/ sit at the top of the source tree, beside tpu_train/, and ship inside the
distribution as the packages tpu_train_configs and tpu_train_recipes, so that ``tpu-train``
finds them from a checkout, an editable install and an installed wheel alike.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["tpu_train", "tpu_train.*"]),
              "tpu_train_configs", "tpu_train_recipes"],
    package_dir={"tpu_train_configs": "configs", "tpu_train_recipes": "recipes"},
)
