"""MkDocs hook: serve the notebooks kept in `notebooks/` (outside `docs/`) as pages.

MkDocs only reads pages from `docs_dir`. Rather than copying the notebook (two copies
to keep in step) or symlinking it (which not every checkout keeps), this adds each
listed notebook to the site's files under the same path it has in the repository,
so the nav names it `notebooks/NAME.ipynb`. It runs before mkdocs-jupyter's
`on_files`, which then renders it like any notebook in `docs/`.
"""

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File


NOTEBOOKS = ("notebooks/mixed_precision_tour.ipynb",)


@event_priority(100)  # before mkdocs-jupyter (priority 0) wraps the notebook files
def on_files(files, config):
    repo_root = pathlib.Path(config.config_file_path).resolve().parent
    for src_uri in NOTEBOOKS:
        path = repo_root / src_uri
        if not path.is_file():
            raise FileNotFoundError(f"The docs show {src_uri}, which does not exist.")
        # A plain File whose source directory is the repository root (mkdocs-jupyter
        # reads `src_dir`, so `File.generated` would not do).
        files.append(
            File(
                src_uri,
                src_dir=str(repo_root),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
