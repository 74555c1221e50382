-- The certificate a worker renewed over its connection, for each certificate issued so:
-- revoking a certificate revokes every certificate renewed from it, so a stolen one
-- cannot outlive its revocation through a renewal made with it.
ALTER TABLE certificates ADD COLUMN renewed_from TEXT;
