package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TLSFiles are the PEM files of a test CA and of a server certificate it
// signed for 127.0.0.1.
type TLSFiles struct {
	CA, Cert, Key string
	Pool          *x509.CertPool // holds the CA
}

// NewTLSFiles makes an ECDSA CA and a server certificate for 127.0.0.1 and
// localhost, valid for an hour, and writes them to a temporary directory.
func NewTLSFiles(t testing.TB) *TLSFiles {
	t.Helper()
	dir := t.TempDir()
	caKey, caDER := newCert(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: "token_bucket test CA"},
		IsCA:    true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}, nil, nil)
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, srvDER := newCert(t, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:    []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, caKey)
	f := &TLSFiles{CA: filepath.Join(dir, "ca.pem"), Cert: filepath.Join(dir, "server.pem"),
		Key: filepath.Join(dir, "server-key.pem"), Pool: x509.NewCertPool()}
	f.Pool.AddCert(ca)
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, f.CA, "CERTIFICATE", caDER)
	writePEM(t, f.Cert, "CERTIFICATE", srvDER)
	writePEM(t, f.Key, "EC PRIVATE KEY", keyDER)
	return f
}

// newCert signs tmpl with parent's key (itself when parent is nil).
func newCert(t testing.TB, tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Minute), time.Now().Add(time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	return key, der
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// StartTLS runs redis-server with TLS only (no plain port) with the files'
// certificate, not asking clients for certificates.
func StartTLS(t testing.TB, f *TLSFiles, extra ...string) *Server {
	t.Helper()
	conf := &tls.Config{RootCAs: f.Pool, MinVersion: tls.VersionTLS12}
	return startWith(t, conf, func(s *Server) []string {
		args := baseArgs(s, "--port", "0", "--tls-port", strconv.Itoa(s.Port))
		args = append(args, "--tls-cert-file", f.Cert, "--tls-key-file", f.Key,
			"--tls-ca-cert-file", f.CA, "--tls-auth-clients", "no")
		return append(args, extra...)
	})
}
