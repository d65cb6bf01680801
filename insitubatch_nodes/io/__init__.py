"""Everything that knows zarr and the object store: opening stores, reading array metadata
into geometries, coordinates along the sample axis, decoding stored objects and reading local
files. This face re-exports the names a composer uses; import the modules for the rest.

* :mod:`~insitubatch_nodes.io.stores` — a store by URL or path (obstore), with a retry policy;
* :mod:`~insitubatch_nodes.io.store_urls` — what a store URL's parts name, checked at open;
* :mod:`~insitubatch_nodes.io.arrays` — finding arrays in a store, :func:`open_geometries`;
* :mod:`~insitubatch_nodes.io.geometry` — :class:`ArrayGeometry`: what a sample is, which
  stored objects hold it, and its views (shifts, windows, patches, selections);
* :mod:`~insitubatch_nodes.io.collection` — :class:`Collection`: many arrays of one schema as
  one virtual array per variable; :mod:`~insitubatch_nodes.io.members` its member map;
  :mod:`~insitubatch_nodes.io.routing` — several stores read as one;
* :mod:`~insitubatch_nodes.io.product` — :class:`ProductGrid`: product sample axes
  (``sample_axis=("t", "z")``), every combination of indices one sample on a virtual axis;
* :mod:`~insitubatch_nodes.io.ngff` — OME-NGFF HCS plates: :func:`read_plate` (their
  metadata, read concurrently), :func:`open_plate` (their fields as one collection);
  :mod:`~insitubatch_nodes.io.ngff_images` — :func:`open_images`: other multiscale images (a
  bioformats2raw conversion's series, an image at a store's root) as one collection;
  :mod:`~insitubatch_nodes.io.ngff_fields` — what both share (metadata documents, levels,
  labels, the images read together); :mod:`~insitubatch_nodes.io.omero` — their ``omero``
  channel names;
* :mod:`~insitubatch_nodes.io.axes` — :func:`axis_of`: an axis named by index or dimension name;
* :mod:`~insitubatch_nodes.io.patching` — :class:`Patches`: how a patched view cuts its field
  into windows;
* :mod:`~insitubatch_nodes.io.selection` — what a selected view keeps of each field axis;
* :mod:`~insitubatch_nodes.io.coords` — coordinates along the sample axis (CF time);
  :mod:`~insitubatch_nodes.io.cf_decode` — their stored values CF-decoded, as xarray does;
* :mod:`~insitubatch_nodes.io.calendars` — CF calendars: ``datetime64`` or cftime dates, counts;
* :mod:`~insitubatch_nodes.io.timeunits` — time unit words: CF ``"<unit> since"`` as xarray reads
  them, and steps such as ``"6h"``;
* :mod:`~insitubatch_nodes.io.decode` — one stored object into its slot memory;
* :mod:`~insitubatch_nodes.io.localfiles` — a local store's files, read on the decode threads;
* :mod:`~insitubatch_nodes.io.objects` — stored objects read (GETs, with their identities) and
  identified (HEADs);
* :mod:`~insitubatch_nodes.io._zarr_compat` — the only module touching zarr's internals.
"""

from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.coords import Coordinate, open_coordinates
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.geometry import ArrayGeometry, Patches
from insitubatch_nodes.io.ngff import Plate, PlateField, open_plate, read_plate
from insitubatch_nodes.io.ngff_images import open_images, read_images
from insitubatch_nodes.io.stores import SUPPORTED_SCHEMES, RetryPolicy, open_store

__all__ = [
    "SUPPORTED_SCHEMES",
    "ArrayGeometry",
    "ChunkDecoder",
    "Collection",
    "Coordinate",
    "Patches",
    "Plate",
    "PlateField",
    "RetryPolicy",
    "open_coordinates",
    "open_geometries",
    "open_images",
    "open_plate",
    "open_store",
    "read_images",
    "read_plate",
]
