"""What people look at and run: the ``relpos`` command line, plots, the explore page, the attention benchmark."""
