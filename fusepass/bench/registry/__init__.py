"""The benchmark registry read by ``fusepass bench``: one ``<op>.py`` per op (see ``common.py``)."""
