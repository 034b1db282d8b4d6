"""C-STORE (PS3.4 Annex B) for writing back to a ``dimse://`` PACS: the DIMSE client of ingest with a store
operation, on an association of its own that proposes each SOP class with the uncompressed transfer syntaxes.
Needs pynetdicom (the ``[pacs]`` extra)."""

from __future__ import annotations

from pydicom import Dataset
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

from medload.errors import RemoteSourceError
from medload.extras import require
from medload.pacs.dimse import DimseClient

require("pynetdicom", "pacs", "Storing to a dimse:// PACS (C-STORE)")
from pynetdicom import build_context  # noqa: E402
from pynetdicom.status import code_to_category  # noqa: E402

__all__ = ["DimseStoreClient"]


class DimseStoreClient(DimseClient):
    """The DIMSE client with C-STORE, on an association of its own (the query/retrieve association proposes
    storage with the SCP role only, for C-GET)."""

    def store(self, datasets: list[Dataset]) -> None:
        self.close()
        contexts = [build_context(sop, [ExplicitVRLittleEndian, ImplicitVRLittleEndian])
                    for sop in sorted({str(ds.SOPClassUID) for ds in datasets})]
        assoc = self._ae.associate(self.endpoint.host, self.endpoint.port, contexts, ae_title=self.endpoint.called_aet)
        if not assoc.is_established:
            raise self._rejected(assoc.acceptor.primitive) if assoc.is_rejected else self._unreachable()
        try:
            for n, ds in enumerate(datasets):
                status = assoc.send_c_store(ds)
                code = status.get("Status") if status is not None else None
                if code is None:
                    raise RemoteSourceError(f"{self.base} ended the association during a C-STORE, or answered "
                                            f"nothing within {self.timeout:g} s ({n} of {len(datasets)} instance(s) "
                                            "stored): check that the PACS accepts storage from AE title "
                                            f"{self.calling_aet}, and its log")
                category = code_to_category(code)
                if category not in ("Success", "Warning"):
                    raise RemoteSourceError(f"{self.base} refused a C-STORE (status 0x{code:04X}, {category}; {n} of "
                                            f"{len(datasets)} instance(s) stored): check that the PACS lets AE title "
                                            f"{self.calling_aet} store and accepts the SOP class, and its log")
        except ValueError as exc:  # pynetdicom: no accepted presentation context for the dataset
            raise RemoteSourceError(f"{self.base} accepted no presentation context to store the instance ({exc}): "
                                    "check that the PACS accepts Segmentation Storage") from None
        finally:
            if assoc.is_established:
                assoc.release()
