"""Models: one folder per family (``gpt/``, ``llama/``, ``rnn/``, ...), each a torch-free ``spec.py`` and a
``model.py``; :mod:`meshtrain.models.registry` lists them and is the only reader of ``model.type``;
:mod:`meshtrain.models.family` is the contract a family fills in. Shared: ``base.py`` (the layered model every
family builds on), ``attention.py`` (the decoders' attention pieces), ``tp_plan.py`` (the tensor-parallel plan),
``hf_io.py`` (Hugging Face files, torch-free), ``hf.py`` (Hugging Face weights in and out) and ``build.py``
(:func:`meshtrain.models.build.build_model`: the torch module of ``model.type``).

This package imports nothing at load time, so torch-free modules (config, the registry) can import from it.
"""
