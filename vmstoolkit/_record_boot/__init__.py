"""The start-up hook of ``vmstoolkit record`` (its directory goes on the recorded command's PYTHONPATH)."""
