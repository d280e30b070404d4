"""The capability suite (issue 53): can a model retrieve what it saw far away?

    python -m linformer_ds.capability copy MODEL DATA ...   # copy at distance on real rows
    python -m linformer_ds.capability probe --kinds ...     # synthetic recall / copy probes

:mod:`.copy_distance`: a passage of a real row repeated d tokens later and masked, scored with the
original in view and with it replaced, for any export or checkpoint (the loading and scoring of
:mod:`linformer_ds.context_curve`). :mod:`.probe`: small models of any attention kinds trained
the same way from scratch on the rows of :mod:`.tasks`, accuracy against distance. See
docs/capability.md.
"""
